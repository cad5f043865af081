"""The ``torch.amp.GradScaler`` handshake shared by optkit optimizers and wrappers.

``GradScaler.step`` looks for ``_step_supports_amp_scaling`` on an optimizer: where it is true it passes
the scale (``grad_scale``) and the inf flag (``found_inf``) to ``step()`` instead of unscaling ``.grad``
itself and syncing on the flag. optkit folds both into the update (one pass, no host sync), so it is on by
default; the public switch is :attr:`AmpProtocol.amp_protocol`.
"""

from __future__ import annotations


class AmpProtocol:
    """Mixin: the ``amp_protocol`` switch over ``_step_supports_amp_scaling``."""

    _step_supports_amp_scaling = True  # read by torch.amp.GradScaler and Lightning

    @property
    def amp_protocol(self) -> bool:
        """Whether ``torch.amp.GradScaler`` hands ``grad_scale``/``found_inf`` to ``step()`` (True, the
        default: unscaling and the skip fold into the update, no extra pass and no host sync) or unscales
        ``.grad`` itself before ``step()`` (False). Set it to False where a framework clips gradients between
        unscaling and the step and refuses optimizers that unscale internally: Lightning's
        ``gradient_clip_val`` under ``precision="16-mixed"``/``"bf16-mixed"``. (Clipping inside the optimizer,
        ``global_clipnorm=``, needs neither.)"""
        return bool(self._step_supports_amp_scaling)

    @amp_protocol.setter
    def amp_protocol(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"`amp_protocol` must be a bool, got {value!r}")
        self._step_supports_amp_scaling = value
