"""The class of every warning the package issues, so that a test run (or a user) can filter them as one.

``ZeroOffloadWarning`` is a ``UserWarning``; what is a ``RuntimeWarning`` by nature (a step skipped for
inf/nan gradients, memory the OS refused to pin, kernels missing) is a :class:`ZeroOffloadRuntimeWarning`,
both at once.
"""


class ZeroOffloadWarning(UserWarning):
    """A warning of lightning_zero_offload."""


class ZeroOffloadRuntimeWarning(ZeroOffloadWarning, RuntimeWarning):
    """A warning of lightning_zero_offload about what happened at run time."""
