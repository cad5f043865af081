"""The engine: everything an optkit optimizer is besides its math.

An optimizer (:mod:`optkit.sgd`, :mod:`optkit.lion`, ...) is its rule: a pointwise update (``_pointwise``,
the form the compiled and fallback paths run), its hyperparameters and slots, optionally a fast ``_update``
(a torch fused kernel) and a per-tensor ``_prepare`` (LARS's and LAMB's norms), and one declaration of how
the engine runs it (:class:`~optkit._core.traits.Traits`). :class:`optkit.optimizer.Optimizer` composes the
engine's parts around it and keeps the torch- and Keras-facing surface; ``step()`` is the pipeline of its
module doc. The parts, one concern each:

=================  =========================================================================================
``traits``         the rule's declaration: decoupled decay, blocks, sparse form, what it does with gradients
``context``        the step protocol as values: :class:`StepContext` in, :class:`StepResult` out
``interface``      ``opt.engine``: what wrappers, the train op and checkpoint helpers may ask of an optimizer
``params``         parameters and param groups checked and normalised (names, duplicates, dtypes)
``groups``         param groups, their checks and names, the weight-decay exclusions
``slots``          per-parameter state made at construction (a skipped step creates nothing), Keras ``build``
``state``          state mappings that count their changes (cached plans follow the slots)
``learning_rate``  each group's learning rate on device: numbers, tensors, schedules, callables, ``lr_scale``
``gradients``      reading and zeroing gradients, sparse gradients, unscale and the clip options
``plan``           the cached structure of a group's pass: blocks, flat parts and their row runs
``passes``         the eager passes: decay → rule → EMA block by block, flat buffers, in-cache copies
``fused``          the gate every call of a torch fused kernel passes (layouts, dtypes, devices)
``chain``          the pointwise rule run tensor by tensor: the ``jit_compile`` chain and the fallback
``compiled``       ``jit_compile``: the chain ``torch.compile``-d per group, with its fallback
``lowp``           low-precision formats: split fp32 masters, Kahan, stochastic rounding, 8-bit blocks
``lean``           the lean pass: bfloat16 weights without masters, slots in bfloat16 or 8 bits, checkpoints
``ema``            moving averages of the parameters and buffers (Keras ``use_ema``)
``checkpoint``     ``state_dict`` / ``load_state_dict`` and pickling
``state_dict``     a loaded state dict checked before anything changes; torch checkpoints' group keys
``tf_surface``     the TF1/Keras methods (``minimize``, ``apply_gradients``, ``get_slot``, configs)
=================  =========================================================================================

The engine knows no wrapper and no train op: they drive it through ``apply_step(StepContext)`` and
``opt.engine``.
"""
