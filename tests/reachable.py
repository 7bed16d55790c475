"""An independent count of the memory an object holds: every tensor reachable from it through
Python references, by the bytes of each distinct storage (a view holds its whole storage)."""

from __future__ import annotations

import gc

import torch


def reachable_storage_bytes(root: object) -> int:
    """Bytes of the distinct tensor storages reachable from `root` (modules, lists, dicts, slots)."""
    seen, storages, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
            continue
        todo.extend(gc.get_referents(obj))
        slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
        todo.extend(getattr(obj, s) for s in slots if hasattr(obj, s))
    return sum(storages.values())
