"""A snapshot's state split in two: the tensors, which DCP writes, and everything else (optimizer
param groups, scaler state), which goes to meta.json as JSON (`split_state`); the non-tensor parts
of every rank merged into one record (`merge_ranks`: pipeline stages hold different parameters);
and on load the JSON put back in place of this run's own values (`put_rest`)."""
from __future__ import annotations

import torch


def split_state(tree):
    """(tensors, rest): the same nested dicts, one holding the tensor leaves (for DCP), the other
    every non-tensor subtree (for JSON), None where a side has nothing."""
    if torch.is_tensor(tree):
        return tree, None
    if isinstance(tree, dict):
        tensors, rest = {}, {}
        for k, v in tree.items():
            t, r = split_state(v)
            if t is not None:
                tensors[k] = t
            if r is not None:
                rest[k] = r
        return tensors or None, rest or None
    if isinstance(tree, (list, tuple)) and any(split_state(v)[0] is not None for v in tree):
        raise TypeError("tensors inside lists are not supported in snapshots; use dicts")
    return None, tree


def merge_ranks(a, b):
    """One record of every rank's non-tensor state: equal values stay; dicts merge per key,
    lists of dicts per element; lists that differ (e.g. the parameter names of each pipeline
    stage's param group) become their ordered union; other differences keep the lower rank's."""
    if a == b:
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        return {**b, **{k: merge_ranks(v, b[k]) if k in b else v for k, v in a.items()}}
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) == len(b) and all(isinstance(x, dict) for x in [*a, *b]):
            return type(a)(merge_ranks(x, y) for x, y in zip(a, b))
        return type(a)(list(a) + [x for x in b if x not in a])
    return a


def _like(value, template):
    """`value` as JSON gave it back, with tuples where the template (this run's own state) has
    them (AdamW's betas)."""
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: _like(v, template.get(k)) for k, v in value.items()}
    if isinstance(template, (list, tuple)) and isinstance(value, list):
        items = [_like(v, template[i] if i < len(template) else None) for i, v in enumerate(value)]
        return tuple(items) if isinstance(template, tuple) else items
    return value


def put_rest(state: dict, stored: dict, where: str = "") -> None:
    """Replace each non-tensor value of `state` (a template: this run's own state) in place with
    the snapshot's JSON record of it; KeyError names one that the snapshot lacks."""
    for k, v in state.items():
        if torch.is_tensor(v):
            continue
        if isinstance(v, dict) and split_state(v)[0] is not None:  # holds tensors: go deeper
            put_rest(v, stored.get(k, {}) if isinstance(stored, dict) else {}, f"{where}{k}.")
        elif isinstance(stored, dict) and k in stored:
            state[k] = _like(stored[k], v)
        else:
            raise KeyError(f"{where}{k}")
