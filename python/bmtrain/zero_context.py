"""ZeroContext (BMTrain's bmtrain.zero_context): the full parameters of a Block outside its forward.

    with bmt.zero_context.ZeroContext(block):
        w = block.weight        # the full tensor (every rank), e.g. to read, log or copy it

On enter the Block gathers its parameters (the engine's all-gather, bmt::Block::gather); on exit it releases
them and each parameter points at its shard again. Collective over the Block's ranks. BMTrain's manual
forward/backward mode (enter(requires_grad=True), exit(backward=True): gradients gathered and reduce-scattered by
hand) is not available: it raises NotImplementedError (the engine reduces gradients itself in the backward).
"""


class ZeroContext:
    def __init__(self, block, ctx_dict=None, pipe=False):
        if not hasattr(block, "_built"):
            raise TypeError(f"ZeroContext: expected a bmt.Block, got {type(block).__name__}")
        self.block = block
        self.ctx_dict = ctx_dict
        self._need_release = False

    def enter(self, flag=0, requires_grad=False):
        if requires_grad or flag != 0:
            raise NotImplementedError("ZeroContext.enter(requires_grad=True / flag != 0): gathering gradient "
                                      "buffers by hand is not available; the engine reduces a Block's gradients in "
                                      "its backward (call the Block, then loss.backward())")
        if self._need_release:
            return
        self.block._built().gather()
        self._need_release = True

    def exit(self, flag=0, backward=False):
        if backward or flag != 0:
            raise NotImplementedError("ZeroContext.exit(backward=True / flag != 0): reducing gradients by hand is not "
                                      "available; the engine reduces a Block's gradients in its backward")
        if not self._need_release:
            return
        self._need_release = False
        self.block._built().release()

    def __enter__(self):
        self.enter()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.exit()
        return False
