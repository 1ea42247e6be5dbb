"""Pack the trained fixture: fp16 copies of the models (same files, same layouts) and a card saying how it was made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json")


def write_fp16(src: Path, dst: Path) -> None:
    """Float tensors to fp16 (integer/bool tensors such as d2t/t2d unchanged); configs and tokenizer copied."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in _COPY:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = "float16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    files = sorted(src.glob("*.safetensors"))
    if len(files) != 1:
        raise RuntimeError(f"{src}: expected one .safetensors file, found {[f.name for f in files]}")
    tensors = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous()
               for k, v in load_file(str(files[0])).items()}
    save_file(tensors, str(dst / files[0].name), metadata={"format": "pt"})


def _mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def write_card(work: Path, out: Path) -> Path:
    """CARD.md and recipe.json from the stage figures in work/ (target.json, heads.json)."""
    t = json.loads((work / "target.json").read_text())
    h = json.loads((work / "heads.json").read_text())
    (out / "recipe.json").write_text(json.dumps({"target": t, "heads": h}, indent=2, sort_keys=True) + "\n")
    r, c, hr = t["recipe"], t["corpus"], h["recipe"]
    e1, e3 = h["eagle1"], h["eagle3"]
    hard = hr.get("hard_ce_weight", 0)
    minutes = (t["stage_seconds"] + h["stage_seconds"]) / 60
    lines = [
        "# Trained tiny fixture: a code target with EAGLE-1/2 and EAGLE-3 heads",
        "",
        "Made from scratch, offline, by `python -m eagle_export.tools.recipe.make_fixture` (see docs/fixture.md) in "
        f"{minutes:.0f} min on this project's 2-core CPU machine. All weights fp16 safetensors; "
        f"target {_mib(out / 'target'):.1f} MiB, EAGLE-1/2 head {_mib(out / 'eagle1'):.1f} MiB, "
        f"EAGLE-3 head {_mib(out / 'eagle3'):.1f} MiB.",
        "",
        "## Corpus and tokenizer",
        f"- Python {c['python']} standard library sources: {c['files']} files, {c['chars'] / 1e6:.1f} M characters, "
        f"sha256 `{c['sha256'][:16]}`; {c['tokens'] / 1e6:.2f} M tokens.",
        f"- Byte-level BPE, {t['vocab']} tokens (`<unk>`, `<s>`, `</s>` = 0, 1, 2), trained on that corpus.",
        "",
        "## Target (`target/`, LlamaForCausalLM)",
        f"- {r['num_hidden_layers']} layers, hidden {r['hidden_size']}, {r['num_attention_heads']} heads / "
        f"{r['num_key_value_heads']} KV head (head_dim {r['hidden_size'] // r['num_attention_heads']}), MLP "
        f"{r['intermediate_size']}, tied embeddings, {t['params'] / 1e6:.2f} M parameters, max positions "
        f"{r['max_position_embeddings']}.",
        f"- {r['steps']} AdamW steps of {r['batch']} x {r['seq_len']} tokens ({t['tokens_seen'] / 1e6:.2f} M tokens), "
        f"lr {r['lr']} cosine; final train loss {t['train_loss']:.3f}, held-out loss {t['val_loss']:.3f} "
        f"({t['seconds'] / 60:.1f} min).",
        "",
        "## Heads",
        f"- Data: {h['data']['sequences']} corpus prompts of {', '.join(map(str, hr['prompt_lens']))} tokens "
        f"({hr['doc_start_share']:.0%} at document starts) continued by the target's own greedy decoding to "
        f"{hr['seq_len']} tokens; features from the target at every position "
        f"(EAGLE-3 taps: inputs of layers {h['data']['tap_layers']}). {hr['heldout']} sequences held out.",
        f"- Training-time test unrolled {hr['unroll']} steps, {hr['steps']} AdamW steps of {hr['batch']} sequences, "
        f"lr {hr['lr']}. EAGLE-1/2 (`eagle1/`, {e1['params'] / 1e6:.2f} M parameters, fc with bias, the target's "
        "embedding and lm_head): smooth-L1 feature regression + soft cross-entropy to the target's next-token "
        f"distribution + {hard} x cross-entropy to the target's greedy token. EAGLE-3 (`eagle3/`, "
        f"{e3['params'] / 1e6:.2f} M parameters, draft vocabulary {e3.get('draft_vocab')} most frequent tokens with "
        f"`d2t`/`t2d`): soft cross-entropy over its vocabulary + {hard} x cross-entropy to the target's greedy "
        "token (ignored where it is outside the draft vocabulary).",
        "",
        "| Head | final loss | held-out top-1 agreement with the target, steps 1..n | greedy chain tau (top-1 only) |",
        "|---|---|---|---|",
        f"| EAGLE-1/2 | {e1['train_loss']:.3f} | {', '.join(f'{x:.2f}' for x in e1['top1_agreement_per_step'])} | "
        f"{e1['chain_tau']:.2f} |",
        f"| EAGLE-3 | {e3['train_loss']:.3f} | {', '.join(f'{x:.2f}' for x in e3['top1_agreement_per_step'])} | "
        f"{e3['chain_tau']:.2f} |",
        "",
        "Agreement is measured on the held-out sequences' generated part, each step given the true (target-greedy) "
        "tokens before it; the chain tau is 1 + the mean run of leading agreeing steps, i.e. what a top-1 chain "
        "of that depth would accept. Trees (top-k > 1) accept more; `eagle-export bench` measures the real tau.",
        "",
    ]
    path = out / "CARD.md"
    path.write_text("\n".join(lines))
    return path
