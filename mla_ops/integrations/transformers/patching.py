"""Reversible attribute patches: what every `patch()` records, and how it is undone.

A `PatchHandle` remembers each attribute it replaced (on a class, or in one module instance's
`__dict__`) and restores exactly the previous objects on `revert()`. One handle is active per
scope (the classes, or one model): applying again to the same scope first reverts the previous
handle, so the newest options win and nothing stacks. Models are held by weak reference: a handle
does not keep a deleted model alive.

Copies are stock. An instance patch lives in the instance's `__dict__`, so `copy.deepcopy`,
`pickle` and `torch.save` would carry it along: bound methods that point back at the original
handle's functions, which no handle of the copy records (so nothing could revert them) and which
pickle cannot even rebuild. Every object given an instance patch therefore also gets a
`__getstate__` in its `__dict__` that returns its state as it was before the patch (the patched
entries restored or removed, attributes the patched code derives, such as absorbed weight copies,
dropped). A copy or a loaded model is a plain stock model; patch() patches it like any other.
"""
from __future__ import annotations

import types
import weakref
from typing import Callable


class PatchHandle:
    """Undoes what one `patch()` did; also a context manager. Reverting twice is harmless.

    One handle is active per scope (the classes, or one model): applying again to the same scope
    first reverts the previous handle, so the newest options win and nothing stacks. Models are
    held by weak reference: a handle does not keep a deleted model alive."""

    def __init__(self, options, scope, derived: tuple[str, ...] = ()):  # options: the PatchOptions it applied
        self.options = options
        self._scope = scope  # "classes", or a weakref to the patched model
        self._records: list[tuple[object, str, object, bool]] = []  # (obj or weakref, name, previous, in_dict)
        self._on_revert: list[Callable[[], None]] = []
        self._derived = derived  # instance attributes the patched code makes: never copied
        self.patched_modules = 0

    @property
    def target(self) -> str:
        if self._scope == "classes":
            return "classes"
        model = self._scope()
        return type(model).__name__ if model is not None else "<deleted model>"

    @property
    def active(self) -> bool:
        return self in _ACTIVE

    def _same_scope(self, scope) -> bool:
        return self._scope == scope if isinstance(scope, str) else (
            not isinstance(self._scope, str) and self._scope() is scope())

    def set(self, obj, name: str, value, *, in_dict: bool = False) -> None:
        """obj.name = value (a class attribute, or an instance __dict__ entry), remembering the old value.
        An instance entry also makes copies of obj stock (see the module docstring)."""
        if in_dict and name != "__getstate__" and self.stock_value(obj, "__getstate__") is _NOT_RECORDED:
            self.set(obj, "__getstate__", types.MethodType(_stock_getstate(self), obj), in_dict=True)
        self._records.append((obj if isinstance(obj, type) else weakref.ref(obj), name,
                              obj.__dict__.get(name, _MISSING), in_dict))
        if in_dict:
            obj.__dict__[name] = value
        else:
            setattr(obj, name, value)

    def stock_state(self, obj) -> dict:
        """obj's pickling state without this handle's instance entries: what a copy of obj gets."""
        state = dict(type(obj).__getstate__(obj))
        for ref, name, previous, in_dict in reversed(self._records):  # the oldest record is the stock value
            if in_dict and ref() is obj:
                if previous is _MISSING:
                    state.pop(name, None)
                else:
                    state[name] = previous
        for name in self._derived:
            state.pop(name, None)
        return state

    def on_revert(self, callback: Callable[[], None]) -> None:
        """Run callback after the attributes are restored (frees state the patched code made later)."""
        self._on_revert.append(callback)

    def stock_value(self, obj, name: str):
        """The value obj.name had before this handle changed it: _MISSING if obj had no own value,
        _NOT_RECORDED if this handle did not change it."""
        for ref, rec_name, previous, _ in self._records:
            if rec_name == name and (ref is obj if isinstance(ref, type) else ref() is obj):
                return previous
        return _NOT_RECORDED

    def revert(self) -> None:
        while self._records:
            ref, name, previous, in_dict = self._records.pop()
            obj = ref if isinstance(ref, type) else ref()
            if obj is None:
                continue  # the model is gone
            if previous is not _MISSING:
                if in_dict:
                    obj.__dict__[name] = previous
                else:
                    setattr(obj, name, previous)
            elif in_dict:
                obj.__dict__.pop(name, None)
            elif name in obj.__dict__:
                delattr(obj, name)
        while self._on_revert:
            self._on_revert.pop()()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.revert()

    def __repr__(self) -> str:
        state = "active" if self.active else "reverted"
        return f"PatchHandle({self.target}, {self.options}, {self.patched_modules} modules, {state})"


def _stock_getstate(handle: PatchHandle):
    """The `__getstate__` installed on an instance-patched object (bound to it): the handle is held
    weakly, and once it is reverted the entry is gone with the rest of the patch."""
    handle_ref = weakref.ref(handle)

    def __getstate__(self):
        live = handle_ref()
        return live.stock_state(self) if live is not None else dict(type(self).__getstate__(self))

    return __getstate__


_ACTIVE: list[PatchHandle] = []
_MISSING = object()
_NOT_RECORDED = object()


def stock_attr(obj, name: str):
    """obj.name as it was before mla_ops patched it (the current value if it is not patched)."""
    for handle in _ACTIVE:
        previous = handle.stock_value(obj, name)
        if previous is _NOT_RECORDED:
            continue
        if previous is not _MISSING:
            return previous
        if isinstance(obj, type):  # the stock value was inherited: look past obj's own (patched) entry
            for base in obj.__mro__[1:]:
                if name in base.__dict__:
                    return base.__dict__[name]
            raise AttributeError(name)
        return getattr(type(obj), name)
    return getattr(obj, name)


def revert() -> None:
    """Undo every patch applied through `patch()` that is still active (newest first)."""
    for handle in reversed(list(_ACTIVE)):
        handle.revert()


def open_handle(options, scope, derived: tuple[str, ...] = ()) -> PatchHandle:
    """A new active handle for `scope` ("classes" or a weakref to a model), after reverting the
    handle already active there: the newest options win and patches never stack. `derived`: the
    instance attributes the patched code makes, left out of copies."""
    _forget_deleted_models()
    for previous in [h for h in _ACTIVE if h._same_scope(scope)]:
        previous.revert()
    handle = PatchHandle(options, scope, derived)
    _ACTIVE.append(handle)
    return handle


def _forget_deleted_models() -> None:
    """Drop the handles of models that no longer exist (their patches died with them)."""
    _ACTIVE[:] = [h for h in _ACTIVE if isinstance(h._scope, str) or h._scope() is not None]


def active_patches() -> list[PatchHandle]:
    """The handles still in effect, oldest first (one per scope: the classes, or a live model)."""
    _forget_deleted_models()
    return list(_ACTIVE)


