"""The library's ranks hide TorchRec's and torch.distributed's notes about their own internals
(the README's library route printed ten FutureWarning lines), and nothing of the user's."""

import logging
import warnings

from recsys_dist.distributed.env import quiet_third_party_noise


def test_third_party_noise_is_hidden_and_a_users_warnings_are_not():
    def warn(message, category, module):
        warnings.warn_explicit(message, category, f"{module}.py", 1, module=module)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_third_party_noise()
        warn("`broadcast_buffers` is deprecated.", FutureWarning, "torchrec.distributed.model_parallel")
        warn("`all_gather_into_tensor` is deprecated.", FutureWarning, "torch.distributed.c10d_logger")
        warn("HeuristicalStorageReservation is known to cause issues", FutureWarning, "recsys_dist.distributed.plan")
        warn(
            "Please use DTensor instead and we are deprecating ShardedTensor.",
            FutureWarning,
            "recsys_dist.checkpoint.dcp",
        )
        warn("my own deprecation", FutureWarning, "my_model")
        warn("a TorchRec UserWarning is still shown", UserWarning, "torchrec.modules")
    assert [str(w.message) for w in seen] == ["my own deprecation", "a TorchRec UserWarning is still shown"]
    assert logging.getLogger("torchrec.distributed.planner").level == logging.ERROR
    assert logging.getLogger("my_model").getEffectiveLevel() == logging.WARNING
