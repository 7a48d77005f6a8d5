"""Renders every chat template of a folder on every conversation of conversations.json the way
transformers' apply_chat_template does (transformers.utils.chat_template_utils
.render_jinja_template, Python's jinja2 in transformers' sandboxed environment), and writes for
each case the exact variables the template was rendered with and the result.

Usage: chat_template_reference.py TEMPLATES_DIR CONVERSATIONS_JSON OUT_DIR

OUT_DIR/manifest.json lists the cases: {"template", "conversation", "context", and either
"expected" (a file holding the rendering, UTF-8) or "error" (the exception's message)}.
"""

import json
import os
import sys

from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template


def capture_render(source):
    """Records the keyword arguments transformers passes to the compiled template's render()."""
    template = _compile_jinja_template(source)  # cached: render_jinja_template gets this object
    if not hasattr(template, "_recorded"):
        original = template.render

        def render(*args, **kwargs):
            template._recorded = kwargs
            return original(*args, **kwargs)

        template.render = render
    template._recorded = None
    return template


def main():
    templates_dir, conversations_path, out_dir = sys.argv[1:4]
    with open(conversations_path, encoding="utf-8") as f:
        spec = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    cases = []
    for template_name in sorted(n for n in os.listdir(templates_dir) if n.endswith(".jinja")):
        with open(os.path.join(templates_dir, template_name), encoding="utf-8", newline="") as f:
            source = f.read()
        tokens = spec["special_tokens"].get(template_name, {"bos_token": "<s>", "eos_token": "</s>"})
        for conv in spec["conversations"]:
            case_id = f"{template_name[:-6]}__{conv['name']}"
            template = capture_render(source)
            kwargs = dict(tokens)
            kwargs.update(conv.get("kwargs", {}))
            case = {"template": template_name, "conversation": conv["name"]}
            try:
                rendered, _ = render_jinja_template(
                    conversations=[conv["messages"]],
                    tools=conv.get("tools"),
                    chat_template=source,
                    add_generation_prompt=conv["add_generation_prompt"],
                    **kwargs,
                )
                expected = os.path.join(out_dir, case_id + ".expected.txt")
                with open(expected, "w", encoding="utf-8", newline="") as f:
                    f.write(rendered[0])
                case["expected"] = expected
            except Exception as e:  # the template raised: kvpipe must raise too
                case["error"] = f"{type(e).__name__}: {e}"
            context = template._recorded
            if context is None:  # failed before rendering: the variables transformers would pass
                context = {"messages": conv["messages"], "tools": conv.get("tools"), "documents": None,
                           "add_generation_prompt": conv["add_generation_prompt"], **kwargs}
            case["context"] = os.path.join(out_dir, case_id + ".context.json")
            with open(case["context"], "w", encoding="utf-8") as f:
                json.dump(context, f, ensure_ascii=False)
            cases.append(case)
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
