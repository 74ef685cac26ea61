"""A sparse layer's stored values trained by SGD beside the dense layer they came from (a test helper)."""
import torch


def assert_trains_like_dense(run, dense, values, stored, inputs, as_matrix=lambda w: w) -> None:
    """SGD on `values` (the sparse layer's stored values, requiring grad) through `run`, beside `dense`: at each
    input, the output equals dense's (the values the last step left, written back into dense's weight) and
    values.grad equals dense's weight gradient at the `stored` positions (as_matrix: dense's weight as the
    sparse layer's rows x cols)."""
    optimizer = torch.optim.SGD([values], lr=0.1)
    for x in inputs:
        optimizer.zero_grad()
        dense.zero_grad()
        got = run(x)
        assert torch.allclose(got, dense(x))
        got.square().sum().backward()
        dense(x).square().sum().backward()
        assert torch.allclose(values.grad, as_matrix(dense.weight.grad)[stored])
        optimizer.step()
        with torch.no_grad():
            as_matrix(dense.weight)[stored] = values
