"""A model of a real model's shape with random weights: for speed runs where the real weights
cannot travel (a GPU machine reached by copying a working tree). Speed does not depend on
the weights; run such benchmarks with EOS ignored.

    # where the GGUF is (here): config.json, tokenizer.json, tokenizer_config.json (~33 MB)
    python benchmarks/random_model.py export --model gemma3-270m --out shared/gemma3-270m-shape
    # where it runs (needs transformers): seeded random weights as model.safetensors
    python benchmarks/random_model.py build --folder shared/gemma3-270m-shape --dtype bfloat16

The folder is then a HF model folder both Loom and transformers load:
`python benchmarks/bench_latency.py --model shared/gemma3-270m-shape --device cuda ...`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def export(model: str, out: Path) -> None:
    """Write the model's HF config and its tokenizer (as HF files) into `out`."""
    from loom.loader.gguf_file import gguf_to_hf_config
    from loom.loader.gguf_reader import GGUFFile
    from loom.loader.resolve import resolve_model_path
    from loom.tokenizer import load_tokenizer

    path = resolve_model_path(model)
    if path.suffix != ".gguf":
        raise SystemExit(f"{path}: export reads a GGUF file's metadata")
    out.mkdir(parents=True, exist_ok=True)
    config = gguf_to_hf_config(GGUFFile(path))
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tok = load_tokenizer(path)
    backend, cfg = tok.backend, tok.config

    def name(token_id: int | None) -> str | None:
        return None if token_id is None else backend.id_to_token(token_id)

    (out / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    tok_cfg = {
        "bos_token": name(cfg.bos_token_id), "eos_token": name(cfg.eos_token_id),
        "pad_token": name(cfg.pad_token_id), "unk_token": name(cfg.unk_token_id),
        "add_bos_token": cfg.add_bos_token, "add_eos_token": cfg.add_eos_token,
        "chat_template": cfg.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2), encoding="utf-8")
    print(f"wrote {out}: config.json, tokenizer.json, tokenizer_config.json")


def build(folder: Path, dtype: str, seed: int, device: str) -> None:
    """Random weights (transformers' initialisation, seeded) for `folder`'s config.json,
    initialised on `device` (a GPU does it in seconds where a CPU takes most of a minute)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(folder))
    print(f"wrote random {dtype} weights to {folder}")


def main() -> None:
    """Parse the subcommand and run it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="config and tokenizer of a GGUF model")
    ex.add_argument("--model", default="gemma3-270m")
    ex.add_argument("--out", type=Path, required=True)
    bu = sub.add_parser("build", help="random weights for an exported folder")
    bu.add_argument("--folder", type=Path, required=True)
    bu.add_argument("--dtype", default="bfloat16")
    bu.add_argument("--seed", type=int, default=0)
    bu.add_argument("--device", default="cpu", help="where to initialise the weights")
    args = parser.parse_args()
    if args.command == "export":
        export(args.model, args.out)
    else:
        build(args.folder, args.dtype, args.seed, args.device)


if __name__ == "__main__":
    main()
