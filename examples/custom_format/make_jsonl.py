"""Write criteo_first2000.jsonl beside this file: the first 2,000 rows of the shipped Criteo
Kaggle sample (datasets/criteo_kaggle, see its SOURCE.md) as JSON lines, an empty field left out."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLE = HERE.parents[1] / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"
NAMES = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


def main(rows: int = 2000, out: Path = HERE / "criteo_first2000.jsonl") -> Path:
    with open(SAMPLE) as src, open(out, "w") as dst:
        for i, line in enumerate(src):
            if i == rows:
                break
            fields = zip(NAMES, line.rstrip("\n").split("\t"))
            obj = {n: (int(v) if n == "label" or n.startswith("I") else v) for n, v in fields if v != ""}
            dst.write(json.dumps(obj) + "\n")
    return out


if __name__ == "__main__":
    print(main())
