"""One rank's weights read from an allspark model file straight into the tensors the model keeps.

The destination of every stored tensor is known before a byte is read: this rank's slice of it (layers/sharding.py),
placed in its model tensor (a merged projection's parts one after the other along dim 0, loader/weights.py's
merged_parts). So the tensors the model will keep are allocated once (on a CPU rank in one huge-page arena) and each
slice is copied into its place from the memory-mapped file: no intermediate copy, concatenation or move. Such
intermediates outlive their use: glibc hands freed heap memory back to the system only from the heap's top, so a
load that clones, concatenates and moves leaves most of those bytes resident beside the weights (the file's pages
count only while it is mapped). A tied LM head is a view of the embedding's rows that it reads, not a copy. A slice with
NaN or inf values is refused, naming its tensor (files written before the loaders refused them, or changed since).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from allspark_server.layers.sharding import SplitMode, TPLayout
from allspark_server.loader.model_file import STORAGE_DTYPES, ModelFile, ModelFileError
from allspark_server.loader.weights import merged_parts, non_finite

EMBEDDING, TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"
Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]   # tensor name -> (shape, dtype)


def stored_slices(mf: ModelFile, tp: TPLayout) -> dict[str, tuple[str, int, int, int]]:
    """Each tensor this rank reads -> (its stored tensor, split dim (-1: whole), lo, hi); a tied LM head that is
    not stored reads the embedding, split by vocabulary."""
    out = {}
    for t in mf.graph.tensors:
        out[t.name] = (t.name, *tp.slice_for(SplitMode(t.split_mode), tuple(t.shape)))
    stored = {t.name: t for t in mf.graph.tensors}
    if mf.args.tie_word_embeddings and TIED_HEAD not in stored and "lm_head.qweight" not in stored:
        if EMBEDDING not in stored:
            raise ModelFileError(f"{mf.weights_path!r}: the tied LM head needs {EMBEDDING}, which it lacks")
        out[TIED_HEAD] = (EMBEDDING, *tp.slice_for(SplitMode.VOCAB, tuple(stored[EMBEDDING].shape)))
    return out


def _slice_shape(shape: tuple[int, ...], dim: int, lo: int, hi: int) -> tuple[int, ...]:
    return shape if dim == -1 else shape[:dim] + (hi - lo,) + shape[dim + 1:]


def _rows(slice_: tuple[str, int, int, int], rows: int) -> tuple[int, int] | None:
    """The rows [lo, hi) of its stored tensor that a slice holds; None for a slice along another dim."""
    _, dim, lo, hi = slice_
    return (0, rows) if dim == -1 else (lo, hi) if dim == 0 else None


def _tied_head_rows(mf: ModelFile, slices: dict[str, tuple[str, int, int, int]]) -> tuple[int, int] | None:
    """Where a tied head that is not stored lies in this rank's embedding: (first row, rows), or None where the
    rank's embedding does not hold the head's rows (then the head is read on its own)."""
    if TIED_HEAD not in slices or slices[TIED_HEAD][0] != EMBEDDING or EMBEDDING not in slices:
        return None
    vocab = next(t.shape[0] for t in mf.graph.tensors if t.name == EMBEDDING)
    head, emb = _rows(slices[TIED_HEAD], vocab), _rows(slices[EMBEDDING], vocab)
    if head is None or emb is None or not emb[0] <= head[0] <= head[1] <= emb[1]:
        return None
    return head[0] - emb[0], head[1] - head[0]


def state_layout(mf: ModelFile, slices: dict[str, tuple[str, int, int, int]], model: nn.Module
                 ) -> tuple[Specs, dict[str, tuple[str, int]], dict[str, tuple[str, int, int]]]:
    """For the tensors `slices` reads (stored_slices): (the model state's tensors to allocate, each read tensor ->
    (its model tensor, first row there), model tensors that are rows of another: a tied head -> (the embedding,
    first row, rows); on more ranks than one the embedding is whole and the head a vocabulary slice of it)."""
    stored = {t.name: t for t in mf.graph.tensors}
    shapes = {}
    for name, (src, dim, lo, hi) in slices.items():
        dtype = stored[src].dtype
        if dtype not in STORAGE_DTYPES:
            raise ModelFileError(f"{mf.weights_path!r}: tensor {src} has unknown dtype {dtype!r}")
        shapes[name] = (_slice_shape(tuple(stored[src].shape), dim, lo, hi), STORAGE_DTYPES[dtype])
    aliases = {}
    head_rows = _tied_head_rows(mf, slices)
    if head_rows is not None:
        aliases[TIED_HEAD] = (EMBEDDING, *head_rows)
    places = {name: (name, 0) for name in shapes if name not in aliases}
    specs = {name: shapes[name] for name in places}
    for merged, keys in merged_parts(model):
        if keys[0] not in shapes:
            continue
        missing = [k for k in keys if k not in shapes]
        if missing:
            raise ModelFileError(f"{mf.weights_path!r} lacks tensors {missing} of {merged}")
        parts = [shapes[k] for k in keys]
        if len({(s[1:], d) for s, d in parts}) > 1:
            raise ModelFileError(f"{mf.weights_path!r}: the parts {keys} of {merged} disagree in shape or dtype: "
                                 f"{[(tuple(s), str(d)) for s, d in parts]}")
        row = 0
        for key, (shape, _) in zip(keys, parts):
            specs.pop(key)
            places[key] = (merged, row)
            row += shape[0]
        specs[merged] = ((row,) + parts[0][0][1:], parts[0][1])
    return specs, places, aliases


def cpu_state(specs: Specs) -> dict[str, torch.Tensor]:
    """A CPU rank's model tensors: one huge-page arena (ordinary pages where there are none)."""
    from allspark_server.step.hugepages import zeros
    return zeros(specs)


def device_state(device: torch.device) -> Callable[[Specs], dict[str, torch.Tensor]]:
    """An allocator of model tensors on `device` (a GPU rank's: each slice goes from the file straight there)."""
    return lambda specs: {name: torch.empty(shape, dtype=dtype, device=device)
                          for name, (shape, dtype) in specs.items()}


def read_rank_state(mf: ModelFile, tp: TPLayout, model: nn.Module,
                    allocate: Callable[[Specs], dict[str, torch.Tensor]] = cpu_state) -> dict[str, torch.Tensor]:
    """This rank's model state dict (merged projections merged, names as `model.state_dict()`), every slice read
    from the file into tensors that `allocate` makes once; ModelFileError names what is wrong with the file."""
    slices = stored_slices(mf, tp)
    specs, places, aliases = state_layout(mf, slices, model)
    state = allocate(specs)
    try:
        _copy_slices(mf, slices, state, places)
    except ModelFileError:
        raise
    except Exception as e:
        raise ModelFileError(f"{mf.weights_path!r} is not a valid .asparam file: {e}") from None
    for name, (target, row, rows) in aliases.items():
        state[name] = state[target].narrow(0, row, rows)
    return state


def _copy_slices(mf: ModelFile, slices: dict[str, tuple[str, int, int, int]], state: dict[str, torch.Tensor],
                 places: dict[str, tuple[str, int]]) -> None:
    from safetensors import safe_open

    with safe_open(mf.weights_path, framework="pt") as f:
        missing = {src for src, *_ in slices.values()} - set(f.keys())
        if missing:
            raise ModelFileError(f"{mf.weights_path!r} lacks tensors {sorted(missing)[:5]}")
        for name, (target, row) in places.items():
            src, dim, lo, hi = slices[name]
            view = _file_view(f, src, dim, lo, hi)
            dest = state[target]
            if target != name:
                dest = dest.narrow(0, row, view.shape[0])
            if dest.shape != view.shape or dest.dtype != view.dtype:
                raise ModelFileError(f"{mf.weights_path!r}: tensor {src} is {str(view.dtype)}{list(view.shape)} in "
                                     f"the file, its graph says {str(dest.dtype)}{list(dest.shape)}")
            dest.copy_(view)
            del view   # the file's mapping lives as long as a view of it does
            why = non_finite(dest)
            if why is not None:
                raise ModelFileError(f"{mf.weights_path!r}: tensor {src}: {why}, and a model with such weights "
                                     f"computes NaN logits")


def _file_view(f, name: str, dim: int, lo: int, hi: int) -> torch.Tensor:
    """This rank's slice of a stored tensor: a view of the memory-mapped file where safetensors gives one."""
    sl = f.get_slice(name)
    if dim == -1:
        return sl[:]
    if dim == 0:
        return sl[lo:hi]
    if dim == 1:
        return sl[:, lo:hi]
    raise ModelFileError(f"{name}: no slicing along dim {dim}")
