"""Every recsys_dist process (the command line's and a library user's ranks) hides the
third-party warnings and log lines a user cannot act on, each named with its reason
(``recsys_dist.logs``), and nothing else: a user's own warnings, and TorchRec's other ones, are
shown. (The command line used to hide every UserWarning, FutureWarning and DeprecationWarning,
a user's included; the library route showed TorchRec's zero-element, "Sharding spec not found"
and fx lines on every rank.)"""

import logging
import warnings

from recsys_dist.logs import THIRD_PARTY_LOGGERS, THIRD_PARTY_RECORDS, THIRD_PARTY_WARNINGS, quiet_third_party


def _warn(message, category, module):
    warnings.warn_explicit(message, category, f"{module}.py", 1, module=module)


def test_known_third_party_warnings_are_hidden_and_nothing_else():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_third_party()
        _warn("`broadcast_buffers` is deprecated.", FutureWarning, "torchrec.distributed.model_parallel")
        _warn("`all_gather_into_tensor` is deprecated.", FutureWarning, "torch.distributed.c10d_logger")
        _warn("HeuristicalStorageReservation is known to cause issues", FutureWarning, "recsys_dist.distributed.plan")
        _warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning, "recsys_dist.ckpt")
        _warn("Initializing zero-element tensors is a no-op", UserWarning, "torch.nn.modules.linear")
        _warn(
            "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered to the "
            "Autograd key(s) but we are trying to backprop through it.",
            UserWarning,
            "torch.autograd.graph",
        )
        # Shown: the user's own, and TorchRec's warnings not on the list.
        _warn("my own deprecation", FutureWarning, "my_model")
        _warn("my own user warning", UserWarning, "my_model")
        _warn("a TorchRec UserWarning is still shown", UserWarning, "torchrec.modules")
    assert [str(w.message) for w in seen] == [
        "my own deprecation",
        "my own user warning",
        "a TorchRec UserWarning is still shown",
    ]


def test_known_third_party_log_lines_are_hidden_and_nothing_else(caplog):
    quiet_third_party()
    caplog.set_level(logging.WARNING)
    logging.warning("Sharding spec not found for model.sparse_arch.t_genres")  # TorchRec logs it on the root
    logging.getLogger("torchrec.distributed.utils").warning(
        "Sharding Type is data_parallel, caching params will be ignored"
    )
    logging.getLogger("torch.fx._symbolic_trace").warning(
        "is_fx_tracing will return true for both fx.symbolic_trace and torch.export. Please use ..."
    )
    logging.getLogger("torchrec.distributed.train_pipeline.tracing").warning(
        "Found module ManagedRemap(...) that potentially modifies input KJT."
    )
    pipeline = logging.getLogger("torchrec.distributed.train_pipeline.utils")
    pipeline.warning("Module 'model.sparse_arch' will NOT be pipelined, due to input modifications")
    pipeline.warning("Sharded modules were not pipelined: model.sparse_arch. This should be fixed ...")
    # DMPCollection (sharding.replica_groups) on the root logger, four lines per rank.
    logging.warning("[2D] Use inter host all reduce: False")
    logging.warning("[Connection] 2D Device Mesh created: DeviceMesh((replicate=2, shard=1), 'cpu')")
    logging.warning("[Connection] 2D sharding_group: [0] -> [DeviceMesh((shard=1), 'cpu')]")
    logging.warning("[Connection] 2D replica_group: [0] -> [DeviceMesh((replicate=2), 'cpu')]")
    logging.warning("the user's own root warning")
    logging.warning("my [Connection] 2D replica_group note")  # not at the start: the user's
    logging.getLogger("torchrec.distributed.utils").warning("another TorchRec warning")
    logging.getLogger("torchrec.distributed.train_pipeline.utils").warning("Module 'x' will be pipelined")
    assert [r.getMessage() for r in caplog.records] == [
        "the user's own root warning",
        "my [Connection] 2D replica_group note",
        "another TorchRec warning",
        "Module 'x' will be pipelined",
    ]
    for name, _ in THIRD_PARTY_LOGGERS:
        assert logging.getLogger(name).level == logging.ERROR
    assert logging.getLogger("torchrec").level == logging.NOTSET  # TorchRec's other loggers are left alone
    assert logging.getLogger("my_model").getEffectiveLevel() <= logging.WARNING


def test_each_filter_says_why():
    rows = [w[-1] for w in THIRD_PARTY_WARNINGS] + [r[-1] for r in THIRD_PARTY_RECORDS]
    rows += [why for _, why in THIRD_PARTY_LOGGERS]
    assert all(isinstance(why, str) and len(why) > 30 for why in rows), rows


def test_quiet_third_party_adds_each_log_filter_once():
    quiet_third_party()
    quiet_third_party()
    for name, pattern, _ in THIRD_PARTY_RECORDS:
        logger = logging.getLogger() if name == "root" else logging.getLogger(name)
        assert [f.pattern.pattern for f in logger.filters if hasattr(f, "pattern")].count(pattern) == 1
