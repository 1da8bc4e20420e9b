"""The library API: ``recsys_dist.Trainer`` in a user's function, run on 2 ranks by
``recsys_dist.launch``, gives the numbers ``recsys-dist train`` gives for the same config."""

import pytest

import recsys_dist
from tests.unit.train.test_trainer import user_job


def test_launch_is_the_function_and_refuses_what_cannot_be_spawned():
    from recsys_dist.train.launch import launch, launch_workers  # noqa: F401 (the submodule, imported)

    assert recsys_dist.launch is launch and callable(recsys_dist.launch)
    with pytest.raises(TypeError, match="not a lambda or a nested function"):
        launch(lambda: 1, 2)
    with pytest.raises(TypeError, match="arguments for .* cannot be pickled"):
        launch(user_job, 2, lambda: 1)
    with pytest.raises(ValueError, match="nproc must be an integer >= 1"):
        launch(user_job, 0)
