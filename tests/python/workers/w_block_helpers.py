"""A small twin check for modules whose torch reference is not built from models.py (e.g. torch.nn.Linear)."""
from common import assert_close, compare_grads, randn, rank, rank_input, world


def check_twins_simple(model, ref, in_shape, what=""):
    """Output and input gradient of this rank's micro-batch, parameter gradients summed over ranks."""
    x = rank_input(rank(), *in_shape, seed=31, requires_grad=True)
    y = model(x)
    (y * randn(*y.shape, seed=32)).sum().backward()
    for r in range(world()):
        xr = rank_input(r, *in_shape, seed=31, requires_grad=True)
        yr = ref(xr)
        (yr * randn(*yr.shape, seed=32)).sum().backward()
        if r == rank():
            assert_close(f"{what}output", y, yr)
            assert_close(f"{what}input grad", x.grad, xr.grad)
    compare_grads(model, ref, what=what)
