"""The prompt of a chat request as transformers and llama.cpp make it, for a GGUF model.

Renders the file's own `tokenizer.chat_template` with transformers' render_jinja_template
(jinja2, as apply_chat_template renders it: one user message, generation prompt on) and
tokenises the result with llama.cpp's tokenizer (llama-cpp-python, special tokens parsed, no
BOS added, as apply_chat_template(tokenize=True) adds none). Prints one JSON object:
{"text": rendered prompt, "ids": [...]}.

    python tests/peer/smollm2_chat_reference.py --model M.gguf --message-file F
"""
import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--message-file", required=True, help="the user message, UTF-8")
    args = parser.parse_args()
    import gguf
    import llama_cpp
    from transformers.utils.chat_template_utils import render_jinja_template

    with open(args.message_file, encoding="utf-8") as f:
        message = f.read()
    reader = gguf.GGUFReader(args.model)
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    tokens = reader.fields["tokenizer.ggml.tokens"]

    def token_text(key):
        f = reader.fields.get(key)
        if f is None:
            return ""
        i = int(f.parts[f.data[0]][0])
        return bytes(tokens.parts[tokens.data[i]]).decode("utf-8")

    rendered = render_jinja_template(
        conversations=[[{"role": "user", "content": message}]], chat_template=template,
        add_generation_prompt=True, bos_token=token_text("tokenizer.ggml.bos_token_id"),
        eos_token=token_text("tokenizer.ggml.eos_token_id"))
    text = rendered[0][0] if isinstance(rendered, tuple) else rendered
    if isinstance(text, list):
        text = text[0]
    llm = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    json.dump({"text": text, "ids": ids}, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
