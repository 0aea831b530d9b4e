"""Which layers of each block tensor parallelism splits, and how: what the model declares, else its structure.

Declared: a transformers model's tensor-parallel plan (``model.tp_plan``, built from the config's
``base_model_tp_plan``: ``"layers.*.self_attn.q_proj": "colwise"``, ...), as ``from_pretrained(tp_plan="auto")``
and Accelerate apply it. phalanx applies its entries inside fsdp's units (the blocks): ``colwise`` and ``rowwise``,
``colwise_gather_output`` and ``rowwise_split_input`` (Phi-3, GLM-4, OLMo-2), ``replicated_with_grad_allreduce``
(Qwen3's and Gemma 3's q and k norms); the layers outside them (embeddings, the head) stay whole on every tp rank and
are sharded by fsdp, as with the structural rule. The heads it splits, query and key/value (grouped-query attention:
fewer key/value heads), must divide by N.

Structural, where nothing is declared, block by block, in the order the block registers its layers:

- an attention (a module keeping its head count: ``num_heads``, ``n_head``, ``num_attention_heads`` ...) splits
  by heads: its q, k, v projections column-wise (k, v may be narrower: key/value heads), its output projection
  row-wise, whether the attention holds it (Llama, T5, nanoGPT) or the next module does (BERT's
  ``attention.output.dense``); a fused q,k,v projection (GPT-2's ``c_attn``) is computed whole and each rank keeps
  its heads' thirds; a per-head table (T5's relative position bias: one column per head) column-wise;
- every other run of projections out of the block's width closed by one back into it (an MLP: ``fc1 -> fc2``,
  ``gate, up -> down``) column- then row-wise; a projection in no such pair stays whole (computed on every rank).

A projection is ``nn.Linear``, or a transposed one (transformers' ``Conv1D``: ``weight`` of shape (in, out)),
split on its transposed dims. Where a plan cannot hold, one line says why and what to do.
"""

from __future__ import annotations

import re
from typing import Optional

from torch import nn

from ...errors import PhalanxError

#: where a module keeps its head count, in the conventions of nanoGPT, torch, torchtitan and Hugging Face
HEAD_ATTRIBUTES = ("n_head", "num_heads", "n_heads", "num_attention_heads")
#: ... and its key/value head count, where it has fewer (grouped-query attention)
KV_ATTRIBUTES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
COLWISE, ROWWISE, FUSED = "column-wise", "row-wise", "fused q,k,v (whole, split by heads)"
#: declared only: a column-wise split whose output is gathered whole (the code after it slices or chunks the whole
#: width: Phi-3's fused q,k,v, GLM-4's fused gate and up, OLMo-2's q and k normed over every head), the row-wise split
#: that follows it (its input whole, each rank taking its part), and a layer kept whole on every tp rank that sees only
#: this rank's heads (Qwen3's and Gemma 3's per-head q and k norms: its gradient summed over the tp ranks)
GATHERED, FROM_WHOLE = "column-wise (output gathered)", "row-wise (input split here)"
REPLICATED = "whole (gradient summed over the tp ranks)"
#: transformers' names of the splits (``base_model_tp_plan``) that apply inside a block, and the kinds they are
DECLARED = {"colwise": COLWISE, "rowwise": ROWWISE, "colwise_gather_output": GATHERED,
            "rowwise_split_input": FROM_WHOLE, "replicated_with_grad_allreduce": REPLICATED}
#: the kinds that give each rank its share of an attention's heads (see ``tp_styles.localise``)
BY_HEADS = (COLWISE, ROWWISE, FUSED)

Plan = dict[str, str]  # {submodule path within the block: one of the kinds above}


def widths(module: nn.Module) -> Optional[tuple[int, int]]:
    """(in, out) of a projection: ``nn.Linear``, or a transposed one (``Conv1D``, weight (in, out)); else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if transposed(module):
        rows, cols = getattr(module, "weight").shape  # (transposed: a 2-d weight)
        return rows, cols
    return None


def _widths(projection: nn.Module) -> tuple[int, int]:
    """(in, out) of one of a block's ``projections`` (modules that :func:`widths` knows)."""
    found = widths(projection)
    assert found is not None, "projections are the modules widths() knows"
    return found


def transposed(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): ``x @ weight + bias`` with weight (in, out), an ``nn.Linear`` transposed."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2
            and getattr(module, "nf", None) == weight.shape[1])


def heads_of(module: nn.Module, names: tuple[str, ...] = HEAD_ATTRIBUTES) -> Optional[int]:
    return next((getattr(module, a) for a in names if isinstance(getattr(module, a, None), int)), None)


# --------------------------------------------------------------------------- declared


def declared(model: nn.Module) -> dict[str, str]:
    """The model's own plan, {module pattern: style}: transformers' ``tp_plan`` (or its config's, prefixed)."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if base and not any(k.endswith(tuple(base)) for k in plan):
        plan.update({(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()})
    return plan


def declared_plan(model: nn.Module, units: list[tuple[str, nn.Module]], n: int) -> Optional[dict[str, Plan]]:
    """The declared plan's entries inside the units, {unit: {path: kind}}; None when it names none of them."""
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"[^.]+") + "$"), k, v) for k, v in declared(model).items()]
    plans: dict[str, Plan] = {}
    for name, unit in units:
        plan: Plan = {}
        for path, _ in unit.named_modules():
            for pattern, key, style in patterns:
                if path and pattern.match(f"{name}.{path}"):
                    if style not in DECLARED:
                        *others, last = DECLARED
                        raise PhalanxError(f"--tensor-parallel: {type(model).__name__} declares '{key}': '{style}', a "
                                           f"split phalanx does not apply inside a block (it applies "
                                           f"{', '.join(others)} and {last}); drop --tensor-parallel")
                    plan[path] = DECLARED[style]
        plans[name] = plan
    if not any(plans.values()):
        return None
    _check_config_heads(model, n)
    for name, unit in units:
        for path, kind in plans[name].items():
            if kind != REPLICATED:
                _check_width(unit.get_submodule(path), kind, f"{name}.{path}", n)
    return plans


def _check_config_heads(model: nn.Module, n: int) -> None:
    config = getattr(model, "config", None)
    for what, names in (("query", HEAD_ATTRIBUTES), ("key/value", KV_ATTRIBUTES)):
        heads = heads_of(config, names) if config is not None else None
        if heads is not None and heads % n:
            raise PhalanxError(f"--tensor-parallel {n}: {type(model).__name__} has {heads} {what} heads, which do not "
                               f"split between {n} ranks; give a --tensor-parallel that divides {heads}")


def _check_width(module: nn.Module, kind: str, path: str, n: int) -> None:
    shape = widths(module)
    if shape is None and isinstance(module, nn.Embedding) and kind == COLWISE:
        shape = (module.num_embeddings, module.embedding_dim)
    if shape is None:
        raise PhalanxError(f"--tensor-parallel: '{path}' ({type(module).__name__}) is not a projection (nn.Linear or "
                           "Conv1D) to split; drop --tensor-parallel")
    width = shape[0] if kind in (ROWWISE, FROM_WHOLE) else shape[1]
    if width % n:
        raise PhalanxError(f"--tensor-parallel {n}: '{path}' has {width} features to split, not divisible by {n}; "
                           f"give a --tensor-parallel that divides {width}")


# --------------------------------------------------------------------------- structural


def model_plan(model: nn.Module, units: list[tuple[str, nn.Module]], n: int) -> dict[str, Plan]:
    """{unit name: {submodule path within it: kind}} for every unit: declared, else structural; or one line why not."""
    plans = declared_plan(model, units, n)
    if plans is None:
        plans = {name: block_plan(unit, n, name) for name, unit in units}
    return plans


def block_plan(block: nn.Module, n: int, where: str) -> Plan:
    """The structural split of one block (see the module's docstring)."""
    projections = [(path, m) for path, m in block.named_modules() if path and widths(m) is not None]
    plan: Plan = {}
    for path, attention in block.named_modules():
        under = _projections_under(projections, path)
        # (an attention with fewer projections computes q, k, v from a parameter, torch's MultiheadAttention's
        # in_proj_weight: it stays whole, and its output projection is one of the rest)
        if heads_of(attention) is not None and len(under) >= 2 and not any(p in plan for p, _ in under):
            plan.update(_attention_plan(attention, path, projections, n, f"{where}.{path}" if path else where))
    plan.update(_mlp_plan([(p, m) for p, m in projections if p not in plan]))
    if not plan:
        kinds = sorted({type(m).__name__ for m in block.modules() if any(True for _ in m.parameters(recurse=False))})
        raise PhalanxError(f"--tensor-parallel: block '{where}' has no attention or MLP projections (nn.Linear or "
                           f"Conv1D) to split (its layers with weights: {', '.join(kinds) or 'none'}); drop "
                           "--tensor-parallel")
    for path, kind in plan.items():
        if kind != FUSED:
            _check_width(block.get_submodule(path), kind, f"{where}.{path}", n)
    return plan


def _projections_under(projections: list[tuple[str, nn.Module]], path: str) -> list[tuple[str, nn.Module]]:
    prefix = f"{path}." if path else ""
    return [(p, m) for p, m in projections if p.startswith(prefix)]


def _attention_plan(attention: nn.Module, path: str, projections: list[tuple[str, nn.Module]], n: int,
                    where: str) -> Plan:
    """q, k, v column-wise and the output projection row-wise (held here or by the next module), or a fused q,k,v
    kept whole; a per-head table (T5's relative position bias) column-wise. Heads checked against N."""
    mine = _projections_under(projections, path)
    heads = heads_of(attention)
    assert heads is not None, "block_plan asks only of a module that has heads"
    first_in, q_width = _widths(mine[0][1])
    plan: Plan = {}
    if len(mine) == 2 and q_width == 3 * _widths(mine[1][1])[0]:  # one projection d -> 3d, split in forward
        if getattr(attention, "split_size", None) != q_width // 3:
            raise PhalanxError(f"--tensor-parallel: '{where}' computes q, k, v in one projection ({mine[0][0]} "
                               f"{first_in}->{q_width}) split in forward by a width phalanx cannot tell (GPT-2 keeps "
                               "it as split_size); give it separate q, k, v projections, or drop --tensor-parallel")
        plan = {mine[0][0]: FUSED, mine[1][0]: ROWWISE}
        q_width //= 3
    else:
        # q, k, v and the output projection held here (Llama, T5, nanoGPT); or q, k, v alone, the output
        # projection being the block's next one (BERT's attention.output.dense)
        after = projections[projections.index(mine[-1]) + 1:]
        inputs, out = (mine[:-1], mine[-1]) if len(mine) >= 4 else (mine, after[0] if after and len(mine) == 3
                                                                      else None)
        if (out is None or _widths(out[1]) != (q_width, first_in)
                or any(_widths(m)[0] != first_in for _, m in inputs)):
            shapes = ", ".join(f"{p} {_widths(m)[0]}->{_widths(m)[1]}" for p, m in mine)
            raise PhalanxError(f"--tensor-parallel: cannot tell the q, k, v and output projections of '{where}' "
                               f"({type(attention).__name__}: {shapes}); its model should declare a tp plan "
                               "(transformers' base_model_tp_plan), or drop --tensor-parallel")
        plan = {p: COLWISE for p, _ in inputs}
        plan[out[0]] = ROWWISE
    head_dim = q_width // heads
    if heads % n:
        raise PhalanxError(f"--tensor-parallel {n}: '{where}' has {heads} heads, which do not split between {n} ranks; "
                           f"give a --tensor-parallel that divides {heads}")
    for name, table in attention.named_children():
        if isinstance(table, nn.Embedding) and table.embedding_dim == heads:
            plan[f"{path}.{name}" if path else name] = COLWISE
    for p, m in mine:
        if plan.get(p) == COLWISE and _widths(m)[1] % head_dim == 0 and (_widths(m)[1] // head_dim) % n:
            raise PhalanxError(f"--tensor-parallel {n}: '{where}' has {_widths(m)[1] // head_dim} heads in {p}, which "
                               f"do not split between {n} ranks; give a --tensor-parallel that divides them")
    return plan


def _mlp_plan(projections: list[tuple[str, nn.Module]]) -> Plan:
    """Runs of projections out of one width closed by one back into it: column-wise, then row-wise."""
    plan: Plan = {}
    run: list[tuple[str, tuple[int, int]]] = []
    for path, module in projections:
        shape = _widths(module)
        if run and shape == tuple(reversed(run[-1][1])):
            plan.update({p: COLWISE for p, s in run if s == run[-1][1]})
            plan[path] = ROWWISE
            run = []
        else:
            run.append((path, shape))
    return plan
