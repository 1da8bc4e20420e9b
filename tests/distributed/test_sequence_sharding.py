"""EmbeddingCollection (sequence) tables: sharded vs unsharded at world sizes 1, 2 and 3,
and every embedding module the sharders do not cover refused at plan time.

The model (``sequence_equivalence.SeqTiny``) reads a pooled table and two sequence tables
(997 x 8, ids 0-5 per example, so empty sequences too, and uneven row shards; 40 x 8, 0-3
ids) from one KeyedJaggedTensor. Each case trains 3 steps; the logits and loss at every step
and every weight after the last step (the updated embedding rows included) must match an
unsharded reference. exact_sgd within 1e-6 absolute (measured worst case 1.2e-7).
exact_rowwise_adagrad within 1e-5: at world size 3 one row of the small table differs by
2.5e-6 for every sharding type alike, data_parallel included, because its gradient is
near zero and Adagrad divides by its own magnitude, amplifying float32 rounding of the
reference's three-loss mean. One spawn per world size serves all cases.
"""

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

from recsys_dist.distributed import sharding
from recsys_dist.testing import run_ranks
from tests.distributed import sequence_equivalence

TYPES = ["data_parallel", "table_wise", "row_wise", "column_wise"]
TOL = {"exact_sgd": 1e-6, "exact_rowwise_adagrad": 1e-5}
CASES = [(t, o) for t in TYPES for o in TOL]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_embedding_collection_every_type_matches_unsharded(world_size):
    results = run_ranks(sequence_equivalence.check_all, world_size, CASES, timeout_s=600)
    failures = []
    for rank, per_case in enumerate(results):
        assert set(per_case) == set(CASES)
        for (st, opt), diffs in per_case.items():
            assert "model.seq.embeddings.s_hist.weight" in diffs  # the updated rows were compared
            bad = {k: v for k, v in diffs.items() if not v <= TOL[opt]}
            if bad:
                failures.append(f"rank {rank} {st} {opt}: {bad}")
    assert not failures, "\n".join(failures)


class WithPlainEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cfg = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
        self.ebc = EmbeddingBagCollection(tables=[cfg], device=torch.device("meta"))
        self.tower = nn.Sequential(nn.Linear(4, 4), nn.Embedding(10, 4))


def test_uncovered_embedding_module_is_an_error_at_plan_time():
    with pytest.raises(ValueError, match=r"tower\.1 is a torch\.nn\.modules\.sparse\.Embedding, which no sharder"):
        sharding.check_covered(WithPlainEmbedding())
    # refused before any process group is needed
    with pytest.raises(ValueError, match="which no sharder covers"):
        sharding.shard(WithPlainEmbedding())
    bag = nn.Module()
    bag.lookup = nn.EmbeddingBag(10, 4)
    with pytest.raises(ValueError, match="lookup is a torch.nn.modules.sparse.EmbeddingBag"):
        sharding.check_covered(bag)


def test_collections_and_their_own_tables_are_covered():
    m = nn.Module()
    m.ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    )
    m.ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=10, feature_names=["g"])]
    )
    sharding.check_covered(m)  # their nn.EmbeddingBag / nn.Embedding children come with them
    sharding.check_covered(m.ebc)  # a collection on its own, too
    sharding.check_covered(m.ec)
    tables = sharding.model_tables(m)
    assert [t.name for t in tables] == ["a", "s"]
    assert sharding.unpooled_names(tables) == {"s"}


def test_unpooled_tables_get_only_the_types_their_sharder_offers():
    cons = sharding.table_constraints(sharding.ShardingConfig(), ["a", "s"], unpooled={"s"})
    assert len(cons["a"].sharding_types) == 6
    assert sorted(cons["s"].sharding_types) == sorted(sharding.SEQUENCE_SHARDING_TYPES)
    only_twrw = sharding.ShardingConfig(sharding_types=["table_row_wise"])
    with pytest.raises(
        ValueError, match=r"sharding.sharding_types: \['table_row_wise'\] leaves the EmbeddingCollection"
    ):
        sharding.table_constraints(only_twrw, ["a", "s"], unpooled={"s"})
    fixed = sharding.ShardingConfig(fixed_plan={"s": {"sharding_type": "table_row_wise", "ranks": [0]}}).fixed_plan
    m = nn.Module()
    m.ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=10, feature_names=["g"])],
        device=torch.device("meta"),
    )
    with pytest.raises(ValueError, match="sharding.fixed_plan.s.sharding_type: table_row_wise"):
        sharding.fixed_sharding_plan(m, fixed, 2, 2, "cpu")
