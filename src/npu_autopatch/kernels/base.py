"""What a kernel is: a name, the torch_npu ops it needs, and its variants.

A variant is a pair of functions:
- ``build(stock, npu)`` returns the replacement for the stock function or method. It closes
  over ``npu`` (the ``torch_npu`` module) and calls the fused ops as its attributes, with the
  documented signatures, unconditionally: no per-call device test, no extra Python frame.
- ``probe(stock, candidate)`` runs the stock code and a candidate built on the CPU golden ops
  on tiny inputs, and returns None when they agree, else why not.
"""


class Variant:
    __slots__ = ("build", "name", "probe")

    def __init__(self, name, build, probe):
        self.name = name
        self.build = build
        self.probe = probe


class Kernel:
    """A named kernel: the torch_npu ops it needs and its variants, tried in order."""

    __slots__ = ("name", "ops", "variants")

    def __init__(self, name, ops, variants):
        self.name = name
        self.ops = ops
        self.variants = variants
