"""Lean export of large models: trace on the meta device without weights, then stream the checkpoint into the graph.

A real-size target does not fit in memory several times over (the loaded model, the exporter's copy, the
ONNX proto, the saved proto). Here the target is built on the meta device (shapes, no data) and traced there
with every parameter and buffer fed in as a graph input (``WeightsAsInputs``), so tracing touches no weight
and takes seconds. ``externalize`` then turns each weight input into an initializer whose bytes are read from
the checkpoint (or, for the small draft head, from memory) one tensor at a time, cast to the graph's dtype,
transposed when the graph only ever uses it transposed (what ``torch.onnx``'s constant folding does for
``nn.Linear``), and appended to the graph's one data file. A tensor used both plain and transposed (a tied
embedding / lm_head) is stored once, as it is, and keeps its ``Transpose`` (see ``_plan``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from eagle_export.errors import CheckpointError
from eagle_export.export.data.datafile import DataWriter, set_external

ONNX_TYPES = {
    torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32, torch.bool: onnx.TensorProto.BOOL,
}
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a safetensors file, read only when it is written."""

    file: Path
    key: str
    shape: tuple[int, ...]

    def load(self) -> torch.Tensor:
        from safetensors import safe_open

        # A handle per tensor: the file's mapping (and the page cache it pulled in) is released with it.
        with safe_open(str(self.file), framework="pt") as f:
            return f.get_tensor(self.key)


@dataclass(frozen=True)
class MemoryTensor:
    """A tensor already in memory (draft head weights, rotary tables, id maps)."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def load(self) -> torch.Tensor:
        return self.tensor


@dataclass(frozen=True)
class StackedExperts:
    """One [experts, rows, cols] parameter from per-expert checkpoint tensors, as transformers 5 merges them when it
    loads (Qwen3-MoE's hub layout ``experts.{e}.gate_proj/up_proj/down_proj.weight``): expert e's parts concatenated
    along their rows (gate then up), the experts stacked."""

    parts: tuple[tuple[CheckpointTensor, ...], ...]  # per expert, the tensors concatenated along dim 0

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0]
        return (len(self.parts), sum(t.shape[0] for t in first), *first[0].shape[1:])

    def load(self) -> torch.Tensor:
        return torch.stack([torch.cat([t.load() for t in row], dim=0) for row in self.parts])


Source = CheckpointTensor | MemoryTensor | StackedExperts

# Fused expert parameters transformers 5 builds from per-expert checkpoint tensors: suffix -> the parts.
STACKED_EXPERTS = {".experts.gate_up_proj": ("gate_proj", "up_proj"), ".experts.down_proj": ("down_proj",)}


def stacked_experts(name: str, index: dict[str, CheckpointTensor]) -> StackedExperts | None:
    """The per-expert checkpoint tensors a fused expert parameter ``name`` is made of, or None."""
    for suffix, parts in STACKED_EXPERTS.items():
        if not name.endswith(suffix):
            continue
        base = name[: -len(suffix)] + ".experts."
        rows = []
        while all(f"{base}{len(rows)}.{p}.weight" in index for p in parts):
            rows.append(tuple(index[f"{base}{len(rows)}.{p}.weight"] for p in parts))
        if rows:
            return StackedExperts(tuple(rows))
    return None


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names, else every *.safetensors file."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"target: {index} is not a safetensors index ({e})") from None
        return sorted({directory / name for name in weight_map.values()})
    return sorted(directory.glob("*.safetensors"))


def checkpoint_index(directory: str | Path) -> dict[str, CheckpointTensor]:
    """Every tensor of a safetensors checkpoint (one file or shards), by key, from the file headers alone."""
    from safetensors import safe_open

    directory = Path(directory)
    files = safetensors_files(directory)
    if not files:
        raise CheckpointError(f"target: {directory} has no safetensors weights (the lean export reads safetensors)")
    index: dict[str, CheckpointTensor] = {}
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"target: {path} is named in {SAFETENSORS_INDEX} but missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    index[key] = CheckpointTensor(path, key, tuple(f.get_slice(key).get_shape()))
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"target: could not read {path}: {e}") from e
    return index


def checkpoint_bytes(directory: str | Path) -> int:
    """Bytes of the checkpoint's weight files (safetensors, else pytorch *.bin)."""
    directory = Path(directory)
    files = safetensors_files(directory) or sorted(directory.glob("*.bin"))
    return sum(p.stat().st_size for p in files if p.is_file())


def checkpoint_sources(model: torch.nn.Module, index: dict[str, CheckpointTensor]) -> dict[int, Source]:
    """Tensor id -> checkpoint tensor for every parameter of a (meta-device) model.

    Tied parameters (one tensor under several names) are read from whichever of their names the checkpoint
    holds. A parameter the checkpoint lacks, or holds with another shape, is an error.
    """
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    sources: dict[int, Source] = {}
    for pid, p in params.items():
        key = next((n for n in names[pid] if n in index), None)
        source = index[key] if key is not None else next(
            (s for s in (stacked_experts(n, index) for n in names[pid]) if s is not None), None)
        if source is None:
            raise CheckpointError(f"target: the checkpoint lacks {' / '.join(names[pid])}")
        if source.shape != tuple(p.shape):
            raise CheckpointError(f"target: {key or names[pid][0]} has shape {source.shape} in the checkpoint, the "
                                  f"config implies {tuple(p.shape)}")
        sources[pid] = source
    return sources


class WeightsAsInputs(torch.nn.Module):
    """Runs ``module`` with each of its parameters and buffers taken from the trailing positional arguments.

    Traced on the meta device, with meta tensors standing in for the weights, the tracer needs no weight data
    and the ONNX exporter sees no parameters (so nothing of the model is copied, folded or inferred from values):
    every weight is a graph input named ``names[i]``, its first name in ``module``.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", module)  # not a submodule: its weights must not become parameters here
        self.slots: list[list[tuple[dict, str]]] = []
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        seen: dict[int, int] = {}
        for prefix, mod in module.named_modules():
            for kind in ("_parameters", "_buffers"):
                d = getattr(mod, kind)
                for key, t in d.items():
                    if t is None:
                        continue
                    if id(t) not in seen:
                        seen[id(t)] = len(self.names)
                        self.names.append(f"{prefix}.{key}" if prefix else key)
                        self.tensors.append(t)
                        self.slots.append([])
                    self.slots[seen[id(t)]].append((d, key))

    def named_modules(self, *args, **kwargs):
        """The wrapped module's, under their own names: torch.onnx names each traced node by the scope of the module
        that made it from this list, so the nodes are named as in the in-memory path (``/layers.1/mlp/...``), which
        is how `validate` finds a graph's layers."""
        return self.inner.named_modules(*args, **kwargs)

    def meta_weights(self) -> list[torch.Tensor]:
        return [torch.empty_like(t, device="meta") for t in self.tensors]

    def forward(self, *args):
        n = len(self.tensors)
        inputs, weights = args[:len(args) - n], args[len(args) - n:]
        try:
            for slots, w in zip(self.slots, weights, strict=True):
                for d, key in slots:
                    d[key] = w
            return self.inner(*inputs)
        finally:
            for slots, t in zip(self.slots, self.tensors, strict=True):
                for d, key in slots:
                    d[key] = t

    def sources(self, known: dict[int, Source]) -> dict[str, Source]:
        """Graph input name -> where its bytes come from: ``known`` (the checkpoint) or the tensor in memory."""
        out: dict[str, Source] = {}
        for name, t in zip(self.names, self.tensors, strict=True):
            src = known.get(id(t))
            if src is None:
                if t.is_meta:
                    raise CheckpointError(f"lean export: no data for {name} (a weight neither in the checkpoint nor "
                                          "in memory)")
                src = MemoryTensor(t.detach())
            out[name] = src
        return out


def _perm(node: onnx.NodeProto) -> list[int] | None:
    for a in node.attribute:
        if a.name == "perm":
            return list(a.ints)
    return None


@dataclass
class _Plan:
    name: str
    source: Source
    transposed: bool


def _plan(graph: onnx.GraphProto, sources: dict[str, Source]) -> tuple[list[_Plan], list[onnx.NodeProto]]:
    """Decide each weight's stored layout and rewrite the nodes around it: a weight only ever read through a
    ``Transpose`` (every ``nn.Linear``) is stored transposed and the Transposes are dropped. A weight read both
    plain and transposed (a tied embedding / lm_head) is stored once as it is, ``[V, H]``, and keeps its
    Transpose: ONNX Runtime folds it into the lm_head's pre-packed weight, and the table stays row-major for the
    ``Gather``s (the target's, and the runtime's gather of the draft's ``input_embeds``). Storing it ``[H, V]``
    instead held the table twice when open (measured: tools/lab/results.md)."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for x in node.input:
            consumers.setdefault(x, []).append(node)
    weights = [i.name for i in graph.input if i.name in sources]
    renamed: dict[str, str] = {}
    dropped: set[int] = set()
    plans = []
    for name in weights:
        uses = consumers.get(name, [])
        flips = [n for n in uses if n.op_type == "Transpose" and _perm(n) == [1, 0]]
        transposed = bool(flips) and len(flips) == len(uses) and len(sources[name].shape) == 2
        if transposed:
            for n in flips:
                renamed[n.output[0]] = name
                dropped.add(id(n))
        plans.append(_Plan(name, sources[name], transposed))
    nodes = []
    for node in graph.node:
        if id(node) in dropped:
            continue
        for i, x in enumerate(node.input):
            if x in renamed:
                node.input[i] = renamed[x]
        nodes.append(node)
    return plans, nodes


TORCH_TYPES = {v: k for k, v in ONNX_TYPES.items()}


def externalize(model: onnx.ModelProto, sources: dict[str, Source], data_path: Path,
                progress: Callable[[int], None] | None = None) -> int:
    """Turn the weight inputs of a graph traced through ``WeightsAsInputs`` into initializers stored in
    ``data_path``, read from ``sources`` one at a time and cast to the input's declared type. Weights no node
    reads are dropped. Returns the bytes written.
    """
    graph = model.graph
    used = {x for node in graph.node for x in node.input}
    types = {i.name: TORCH_TYPES[i.type.tensor_type.elem_type] for i in graph.input if i.name in sources}
    dead = [i.name for i in graph.input if i.name in sources and i.name not in used]
    sources = {k: v for k, v in sources.items() if k in used}
    plans, nodes = _plan(graph, sources)
    del graph.node[:]
    graph.node.extend(nodes)
    weights = {p.name for p in plans} | set(dead)
    kept = [i for i in graph.input if i.name not in weights]
    del graph.input[:]
    graph.input.extend(kept)
    with DataWriter(data_path) as out:
        for plan in plans:
            t = plan.source.load()
            if tuple(t.shape) != tuple(plan.source.shape):
                raise CheckpointError(f"{plan.name}: read shape {tuple(t.shape)}, expected {plan.source.shape}")
            t = t.to(types[plan.name])
            if plan.transposed:
                t = t.t()
            t = t.contiguous()
            size = t.numel() * t.element_size()
            init = onnx.TensorProto(name=plan.name, data_type=ONNX_TYPES[t.dtype], dims=list(t.shape))
            set_external(init, data_path.name, out.write(t.reshape(-1).view(torch.uint8).numpy().data), size)
            graph.initializer.append(init)
            del t
            if progress is not None:
                progress(size)
        return out.offset
