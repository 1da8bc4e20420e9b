"""docs/config.md is the generator's output: regenerated whenever a config section changes."""

from recsys_dist.config.reference import REGENERATE, config_reference
from tests.conftest import ROOT

DOC = ROOT / "docs" / "config.md"


def test_docs_config_md_is_up_to_date():
    want = config_reference()
    have = DOC.read_text(encoding="utf-8") if DOC.is_file() else ""
    assert have == want, f"docs/config.md differs from the config classes; regenerate it: {REGENERATE}"


def test_reference_covers_every_section_and_model():
    text = config_reference()
    sections = ["data", "data.schema", "data.split", "model", "train", "distributed", "sharding"]
    sections += ["sharding.per_table.<table>", "sharding.fixed_plan.<table>", "checkpoint", "eval"]
    shipped = ["dlrm", "dlrm_dcnv2", "dcnv2", "deepfm", "wide_deep", "xdeepfm", "package.module:factory"]
    sections += [f"model.name: {n}" for n in shipped]
    for key in sections:
        assert f"# `{key}`\n" in text, key
    # Literal choices, default_factory values, required keys and bounds are rendered.
    assert "| `pooling` | `sum \\| mean` | `sum` |" in text
    assert (
        "| `compute_kernels` | `list[dense \\| fused \\| fused_uvm \\| fused_uvm_caching]` | `[fused, dense]` |" in text
    )
    assert "| `column` | `str` | required |" in text  # data.schema.labels.<name>
    assert "| `batch_size` | `int` (> 0, <= 16777216) | `128` |" in text
    assert "| `args` | `dict[str, any]` | `{}` |" in text
