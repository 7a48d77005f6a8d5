"""References for the tokenizer parity tests (tests/peer/test_tokenizer_parity.cpp).

  llama MODEL.gguf STRINGS.json OUT.json   llama.cpp (llama-cpp-python, vocab only): for each
      string, the ids without and with BOS (special tokens parsed) and llama_detokenize's text.
  hf DIR STRINGS.json OUT.json             Hugging Face `tokenizers` on DIR/tokenizer.json: ids
      without and with the post-processor's special tokens, and decode()'s text.
  inp FILE.inp FILE.out OUT.json           llama.cpp's own expected tokenizations
      (tests/test-tokenizer-0 format) as {"strings": [...], "ids": [[...], ...]}.
  convert MODEL.gguf OUT_DIR [--merges-as-strings] [--llama2-normalizer]
      tokenizer.json + tokenizer_config.json from a GGUF vocabulary by transformers' own GGUF
      conversion; optionally rewritten with merges as "a b" strings, or (SentencePiece
      vocabularies) with Llama-2's normalizer (Prepend U+2581, Replace " " -> U+2581) instead of
      the Metaspace pre-tokenizer.
"""
import ctypes
import json
import os
import sys


def run_llama(model, strings_path, out_path):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    results = []
    for s in json.load(open(strings_path, encoding="utf-8")):
        data = s.encode("utf-8")
        ids = llm.tokenize(data, add_bos=False, special=True)
        ids_special = llm.tokenize(data, add_bos=True, special=True)
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        size = 16 * len(data) + 64
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, True)
        decoded = buf.raw[: max(n, 0)].decode("utf-8", errors="replace")
        results.append({"ids": ids, "ids_special": ids_special, "decoded": decoded})
    json.dump({"results": results}, open(out_path, "w", encoding="utf-8"), ensure_ascii=False)


def run_hf(directory, strings_path, out_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    results = []
    for s in json.load(open(strings_path, encoding="utf-8")):
        ids = tok.encode(s, add_special_tokens=False).ids
        ids_special = tok.encode(s, add_special_tokens=True).ids
        decoded = tok.decode(ids, skip_special_tokens=False)
        results.append({"ids": ids, "ids_special": ids_special, "decoded": decoded,
                        "decoded_skip": tok.decode(ids_special, skip_special_tokens=True)})
    json.dump({"results": results}, open(out_path, "w", encoding="utf-8"), ensure_ascii=False)


def run_inp(inp, out, out_path):
    sep = "\n__ggml_vocab_test__\n"
    text = open(inp, encoding="utf-8").read()
    strings = text.split(sep)
    # test-tokenizer-0 drops what follows the last separator and the text before the first.
    strings = strings[1:-1] if text.startswith("__ggml_vocab_test__\n") else strings[:-1]
    lines = open(out, encoding="utf-8").read().split("\n")
    ids = [[int(t) for t in line.split()] for line in lines[: len(strings)]]
    json.dump({"strings": strings, "ids": ids}, open(out_path, "w", encoding="utf-8"), ensure_ascii=False)


def run_convert(model, out_dir, flags):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(model)),
                                        gguf_file=os.path.basename(model))
    tok.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer.json")
    j = json.load(open(path, encoding="utf-8"))
    if "--merges-as-strings" in flags:
        j["model"]["merges"] = [m if isinstance(m, str) else m[0] + " " + m[1] for m in j["model"]["merges"]]
    if "--llama2-normalizer" in flags:
        j["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        j["pre_tokenizer"] = None
    json.dump(j, open(path, "w", encoding="utf-8"), ensure_ascii=False)


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "llama":
        run_llama(*args)
    elif mode == "hf":
        run_hf(*args)
    elif mode == "inp":
        run_inp(*args)
    elif mode == "convert":
        run_convert(args[0], args[1], args[2:])
    else:
        sys.exit("unknown mode " + mode)


if __name__ == "__main__":
    main()
