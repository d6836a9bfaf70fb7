"""OpenPopTorch's stand-in for Horovod: only ``horovod.torch``, over
``torch.distributed`` (see :py:mod:`horovod.torch`). Install the real Horovod instead
where it builds; this package is a separate, optional distribution so that it never
shadows one."""
__version__ = "0.28.1+openpoptorch"
