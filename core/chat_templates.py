"""`data.chat_template`: a named template shipped here, or the user's own Jinja; and whether a local model
folder carries a template of its own. Torch-free: the launcher checks both before anything is queued.

The named templates are for models that ship none (base models) and are the forms their families' instruct
models use. A template's special markers (ChatML's `<|im_start|>`, `<|im_end|>`) must be tokens of the
model's vocabulary to be learnt as one token each: add them with `model.added_tokens` when they are not.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.problems import did_you_mean

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Meta-Llama-3-Instruct's own (the 3.1 one adds tools and a dated system turn).
LLAMA_3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
NAMED = {"chatml": CHATML, "llama-3": LLAMA_3}
# Template files a model folder may keep its template in (transformers 5 writes chat_template.jinja).
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def is_jinja(value: str) -> bool:
    return "{{" in value or "{%" in value


def check(value: str) -> None:
    """Raise ValueError unless `value` names a shipped template or is Jinja that parses."""
    if not is_jinja(value):
        if value not in NAMED:
            raise ValueError(
                f"{value!r} is neither a named template ({', '.join(NAMED)}){did_you_mean(value, NAMED)} nor "
                "a Jinja template (one holds {{ }} or {% %}, e.g. a tokenizer_config.json's chat_template)"
            )
        return
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationMarkers(Extension):
        """`{% generation %}...{% endgeneration %}`, the assistant-mask markers transformers adds."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    try:  # the environment transformers renders chat templates in
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols", GenerationMarkers]).parse(value)
    except TemplateSyntaxError as exc:
        raise ValueError(
            f"the Jinja template does not parse: {exc.message} (template line {exc.lineno})"
        ) from None


def text(value: str) -> str:
    """The Jinja of `data.chat_template` (a name or the template itself)."""
    return value if is_jinja(value) else NAMED[value]


def folder_has_template(folder: Path) -> bool | None:
    """Does a local model folder carry a chat template? None when it is no local folder (a hub id, known
    only on the node)."""
    if not folder.is_dir():
        return None
    if any((folder / name).is_file() for name in TEMPLATE_FILES):
        return True
    config = folder / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
