"""A user's chat template rendered in a child process under a time bound and a memory bound.

A template is a program: nested loops run for hours, `'x' * 10**10` allocates 10 GB at once, and a timer in
the same process stops neither in time (the allocation happens inside one C call). So it runs in a child
(this file run as a script, standard library and jinja2 only: the login node stays torch-free) whose
address space is capped with RLIMIT_AS and whose render is interrupted by SIGALRM; the parent kills it if it
outlives the bound anyway. The environment is transformers' own for chat templates (jinja2's immutable
sandbox, trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `tojson`, `strftime_now`,
`{% generation %}`), so what renders here renders there.

    render_bounded(template, calls) → [text, ...] | raises TemplateBoundError (with the template's line)
"""

from __future__ import annotations

import json
import subprocess
import sys

TIME_S = 5.0  # a real template renders a small conversation in milliseconds
MEMORY_BYTES = 1 << 30  # address space of the child: Python and jinja2 take ~60 MB of it


class TemplateBoundError(ValueError):
    """The template raised, ran past the time bound or past the memory bound; says where."""


def render_bounded(
    template: str, calls: list[dict], time_s: float | None = None, keep: bool = True, what: str | None = None
) -> list[str]:
    """Each call's rendering ({messages, add_generation_prompt, bos_token, eos_token}), in a bounded child
    (`time_s`: the time bound of each call, TIME_S when None). `keep=False`: only whether each renders
    within the bounds (nothing comes back); `what`: how the refusal names the conversations rendered."""
    time_s = TIME_S if time_s is None else time_s
    argv = [sys.executable, __file__]
    what = what or "a two-exchange conversation"
    request = json.dumps({"template": template, "calls": calls, "time_s": time_s, "keep": keep, "what": what})
    try:
        done = subprocess.run(
            argv,
            input=request,
            capture_output=True,
            text=True,
            timeout=time_s * len(calls) + 10,
            preexec_fn=cap_memory,
        )
    except subprocess.TimeoutExpired:
        raise TemplateBoundError(f"the chat template ran past {time_s:g} s rendering {what}") from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:  # killed by the kernel, or crashed: say what the child said
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise TemplateBoundError(f"the chat template could not be rendered: {tail}") from None
    if "error" in answer:
        raise TemplateBoundError(answer["error"])
    return answer["texts"]


def cap_memory() -> None:  # runs in the child, before it executes Python
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


# ---- the child ------------------------------------------------------------------------------------------
def environment():
    from datetime import datetime

    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationMarkers(Extension):
        """`{% generation %}...{% endgeneration %}`, the assistant-mask markers transformers adds."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationMarkers]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def template_line(exc: BaseException) -> str:
    """' (template line N)' from the deepest frame jinja2 compiled the template into, else ''."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (template line {line})" if line else ""


def render_all(request: dict) -> dict:
    import signal

    def out_of_time(signum, frame):
        raise TimeoutError

    signal.signal(signal.SIGALRM, out_of_time)
    time_s, keep, what = request["time_s"], request.get("keep", True), request.get("what", "a conversation")
    texts = []
    try:
        # Compiled before the clock starts: the bound is the render's, and on a loaded machine the compile
        # alone once ran past it, refusing a template for no line of its own.
        template = environment().from_string(request["template"])
        for call in request["calls"]:
            what = call.pop("what", what)
            signal.setitimer(signal.ITIMER_REAL, time_s)  # each call's own bound
            text = template.render(**call)
            if keep:
                texts.append(text)
        return {"texts": texts}
    except TimeoutError as exc:
        return {"error": f"the chat template ran past {time_s:g} s rendering {what}{template_line(exc)}"}
    except MemoryError as exc:
        return {
            "error": f"the chat template needed over {MEMORY_BYTES >> 20} MB to render {what}{template_line(exc)}"
        }
    except Exception as exc:  # the template's own raise_exception, an undefined name, a type error
        return {"error": f"the chat template cannot render {what}: {exc}{template_line(exc)}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


if __name__ == "__main__":
    sys.stdout.write(json.dumps(render_all(json.loads(sys.stdin.read()))))
