// Fallback timing of llama.cpp through node-llama-cpp, for compare.sh when llama-bench is not
// built: prompt processing of 512 tokens and greedy decode of 128 tokens after a 16-token
// prompt, batch 1, on a GGUF file. Prints {"pp512_tok_s", "decode_tok_s"} as one JSON line.
// Unlike llama-bench this includes the JavaScript binding's per-token overhead.
//   node benchmarks/peers/llama_timing.mjs --model M.gguf --threads 1
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, "llama-cpp", "package.json"));
const { getLlama } = await import(require.resolve("node-llama-cpp"));
const arg = (k, d) => { const i = process.argv.indexOf(k); return i > 0 ? process.argv[i + 1] : d; };
const modelPath = arg("--model"), threads = Number(arg("--threads", "1"));
const ids = (n) => Array.from({ length: n }, (_, i) => (i * 7919) % 8000 + 3);

const llama = await getLlama({ gpu: false, build: "never", logLevel: "error" });
const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
const context = await model.createContext({ contextSize: 1024, batchSize: 512,
  threads: { ideal: threads, min: threads } });
const sequence = context.getSequence();

let t0 = performance.now();
await sequence.evaluateWithoutGeneratingNewTokens(ids(512));
const pp = 512 / ((performance.now() - t0) / 1000);
await sequence.clearHistory();

let n = 0, first = 0;
for await (const token of sequence.evaluate(ids(16), { temperature: 0, yieldEogToken: true })) {
  if (n === 0) first = performance.now();  // the first token closes the prompt
  if (++n > 128) break;
}
const decode = 128 / ((performance.now() - first) / 1000);
process.stdout.write(JSON.stringify({ pp512_tok_s: pp, decode_tok_s: decode }) + "\n");
await context.dispose();
await model.dispose();
await llama.dispose();
