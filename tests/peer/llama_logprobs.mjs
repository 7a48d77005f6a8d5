// Greedy decoding with llama.cpp (through node-llama-cpp) on a GGUF model, printing each
// step's chosen token and full-vocabulary log-probabilities as one JSON line, in the shape
// of `kvpipe generate --logprobs-out`, so the two can be compared value by value.
//
//   node tests/peer/llama_logprobs.mjs --model M.gguf --prompt 1,17,42 [--steps 32] [--threads 1]
//
// The KV cache is F32 (node-llama-cpp's default is F16, which alone moves log-probabilities
// by more than the comparison's tolerance). Exit 3 when node-llama-cpp is not installed.
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const peerDir = process.env.KVPIPE_LLAMA_CPP_DIR ||
  path.join(here, "..", "..", "benchmarks", "peers", "llama-cpp");

function parseArgs(argv) {
  const args = { steps: 32, threads: 1 };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i], value = argv[i + 1];
    if (value === undefined) throw new Error(`missing value for ${key}`);
    if (key === "--model") args.model = value;
    else if (key === "--prompt") args.prompt = value.split(",").map((s) => Number.parseInt(s, 10));
    else if (key === "--steps") args.steps = Number.parseInt(value, 10);
    else if (key === "--threads") args.threads = Number.parseInt(value, 10);
    else throw new Error(`unknown argument ${key}`);
  }
  if (!args.model || !args.prompt || args.prompt.some(Number.isNaN))
    throw new Error("usage: llama_logprobs.mjs --model FILE.gguf --prompt 1,2,3 [--steps N] [--threads N]");
  return args;
}

async function loadPeer() {
  const require = createRequire(path.join(peerDir, "package.json"));
  let entry;
  try {
    entry = require.resolve("node-llama-cpp");
  } catch {
    process.stderr.write(`llama_logprobs: node-llama-cpp is not installed in ${peerDir} ` +
      "(run scripts/setup.sh)\n");
    process.exit(3);
  }
  return import(entry);
}

const args = parseArgs(process.argv.slice(2));
const { getLlama } = await loadPeer();
// 'never': the prebuilt CPU binary is enough, and building from source here would take minutes.
const llama = await getLlama({ gpu: false, build: "never", logLevel: "error" });
const model = await llama.loadModel({ modelPath: args.model, gpuLayers: 0 });
const context = await model.createContext({
  contextSize: Math.max(256, args.prompt.length + args.steps + 8),
  batchSize: 512,
  threads: { ideal: args.threads, min: args.threads },
  flashAttention: false,
  experimentalKvCacheKeyType: "F32",
  experimentalKvCacheValueType: "F32",
});
const sequence = context.getSequence();
const vocab = model.tokens.vocabSize ?? null;

let step = 0;
const lines = [];
for await (const out of sequence.evaluateWithMetadata(args.prompt, { probabilities: true },
                                                       { temperature: 0, yieldEogToken: true })) {
  const size = vocab ?? out.probabilities.size;
  const logprobs = new Array(size).fill(null);  // null: probability 0 (log is -inf)
  for (const [token, p] of out.probabilities) if (p > 0) logprobs[token] = Math.log(p);
  lines.push(JSON.stringify({ id: 0, step, token: out.token, logprobs }));
  if (++step >= args.steps) break;
}
process.stdout.write(lines.join("\n") + "\n");
await context.dispose();
await model.dispose();
await llama.dispose();
