"""Weight synchronisation between the user's module (host) and the executor's copy.

On the CPU ("IPU Model") the executor's copy shares every parameter and buffer with the
user's module, so there is nothing to copy: trained values are visible at once.

On an accelerator the executor's copy holds device tensors. After a call the host is
stale; reading the user's module (an attribute, ``parameters()``, ``state_dict()``, ...)
copies the device values back first, as PopTorch's implicit copy-to-host does.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Protocol

import torch

from ..._typing import UserInput, UserOutput


class WeightSync:
    """Copies weights between a host module and its device copy when they differ."""

    def __init__(self, host: torch.nn.Module, device_model: torch.nn.Module,
                 device: torch.device) -> None:
        self.shared = device.type == "cpu"
        self.device = device
        self.host_dirty = False
        self._host = host
        self._device_model = device_model
        if not self.shared:
            device_model.to(device)
            install_access_hook(host, self)

    def _pairs(self, buffers: bool = True, params: bool = True,
               buffer_names: Collection[str] | None = None
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        dev: dict[str, torch.Tensor] = \
            dict(self._device_model.named_parameters()) if params else {}
        if buffers:
            dev.update((n, b) for n, b in self._device_model.named_buffers()
                       if buffer_names is None or n in buffer_names)
        host: dict[str, torch.Tensor] = dict(self._host.named_parameters()) if params else {}
        if buffers:
            host.update(self._host.named_buffers())
        for name, tensor in dev.items():
            if name in host:
                yield host[name], tensor

    def mark_device_newer(self) -> None:
        """Called after every run on the device: the host copy is now stale."""
        if not self.shared:
            self.host_dirty = True

    def to_host_if_needed(self) -> bool:
        """Copy device values to the host if they are newer; True if a copy happened."""
        if not self.host_dirty:
            return False
        self.host_dirty = False  # first: reading the host below must not recurse
        with torch.no_grad():
            for host_t, dev_t in self._pairs():
                host_t.copy_(dev_t, non_blocking=False)
        return True

    def to_host(self) -> None:
        """Copy device values to the host unconditionally."""
        self.host_dirty = True
        self.to_host_if_needed()

    def to_device(self, params: bool = True, buffers: bool = True,
                  buffer_names: Collection[str] | None = None) -> None:
        """Copy host values to the device (after the user changed them on the host);
        ``buffer_names`` limits the buffers copied (None: all)."""
        with torch.no_grad():
            for host_t, dev_t in self._pairs(buffers, params, buffer_names):
                if host_t is not dev_t:
                    dev_t.copy_(host_t)
        if not params:
            return
        self.host_dirty = False


_HOOKED_METHODS = ("parameters", "named_parameters", "buffers", "named_buffers",
                   "state_dict", "load_state_dict", "__call__", "forward")


# The weight syncs of each hooked host module, and the hooked class of each module
# unhooked for a while (``unhook`` / ``rehook``).
_SYNCS: weakref.WeakKeyDictionary[torch.nn.Module, list] = weakref.WeakKeyDictionary()
_UNHOOKED: weakref.WeakKeyDictionary[torch.nn.Module, type] = weakref.WeakKeyDictionary()


class HostRefresh(Protocol):
    """What the access hook calls before ``host`` is read: a weight sync, or sharded
    weights that gather first (``memory.step_shards``)."""

    def to_host_if_needed(self) -> bool: ...


def install_access_hook(host: torch.nn.Module, sync: HostRefresh) -> None:
    """Make reads of ``host`` refresh it first: device weights copied back on an
    accelerator, sharded weights gathered."""
    _SYNCS.setdefault(host, []).append(weakref.ref(sync))
    if getattr(type(host), "_poptorch_hooked", False):
        return
    base = type(host)

    def refresh(module: torch.nn.Module) -> None:
        for ref in _SYNCS.get(module, ()):
            s = ref()
            if s is not None:
                s.to_host_if_needed()

    namespace: dict[str, object] = {"_poptorch_hooked": True}

    def make(name: str) -> Callable[..., UserOutput]:
        original = getattr(base, name)

        def method(self: torch.nn.Module, *args: UserInput, **kwargs: UserInput) -> UserOutput:
            refresh(self)
            return original(self, *args, **kwargs)
        method.__name__ = name
        method.__doc__ = original.__doc__
        return method

    for name in _HOOKED_METHODS:
        namespace[name] = make(name)

    def __getattr__(self: torch.nn.Module, name: str) -> torch.Tensor | torch.nn.Module:
        refresh(self)
        return base.__getattr__(self, name)
    namespace["__getattr__"] = __getattr__
    host.__class__ = type(base.__name__, (base,), namespace)


def is_hooked(host: torch.nn.Module) -> bool:
    """True if reads of ``host`` copy device weights back first (see above)."""
    return bool(getattr(type(host), "_poptorch_hooked", False))


def unhook(host: torch.nn.Module) -> bool:
    """Copy newer device weights to ``host`` and give it back its own class, so that it
    can be changed (re-parallelised, ...) without implicit copies. False if not hooked."""
    if not is_hooked(host):
        return False
    hooked = type(host)
    for ref in _SYNCS.get(host, ()):
        sync = ref()
        if sync is not None:
            sync.to_host_if_needed()
    host.__class__ = hooked.__mro__[1]
    _UNHOOKED[host] = hooked
    return True


def rehook(host: torch.nn.Module) -> bool:
    """Undo :func:`unhook`: reads of ``host`` copy device weights back again. False if
    ``host`` was not unhooked."""
    hooked = _UNHOOKED.pop(host, None)
    if hooked is None:
        return False
    host.__class__ = hooked
    return True
