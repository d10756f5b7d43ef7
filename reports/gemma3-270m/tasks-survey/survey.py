"""Which tasks Gemma 3 270M is above chance on here: the fp16 baseline (kvquant's identity cache, streaming, chunk
512) on the first 100 documents of each task, with Wilson 95% intervals against each task's chance level (what a
uniform guess scores; BoolQ: the majority answer). Each result goes through a result store
(``<output_dir>/<name>/partial``), so an interrupted survey resumes.

    python reports/gemma3-270m/tasks-survey/survey.py reports/gemma3-270m/tasks-survey/survey.yaml TASK ...
"""

import json
import math
import sys
import time
from pathlib import Path

from kvquant.runner import report
from kvquant.runner.config import load_config
from kvquant.scoring.session import BASELINE, Session, Split
from kvquant.scoring.models import load_model
from kvquant.planner.shapes import shape_from_config
from kvquant.runner.store import ResultStore
from kvquant.scoring.tasks import gated_metric

#: chance: the share a uniform guess gets (BoolQ: the majority answer, "yes", is 62% of its validation set)
CHANCE = {"arc_easy": 0.25, "hellaswag": 0.25, "piqa": 0.5, "winogrande": 0.5, "boolq": 0.622, "lambada_openai": 0.0}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return mid - half, mid + half


def main(config: str, tasks: list[str]) -> None:
    cfg = load_config(config)
    out = Path(__file__).parent / "survey.json"
    done = json.loads(out.read_text()) if out.exists() else {}
    model, tokenizer = load_model(cfg.model)
    store = ResultStore(Path(cfg.output_dir) / cfg.name / "partial", report.code_version(), [])
    session = Session(cfg, model, tokenizer, store, shape_from_config(model.config, cfg.model.path))
    for task in tasks:
        start = time.monotonic()
        measured = session.measure(BASELINE, Split("evaluation", {}, {task: None}))
        metric = gated_metric(task)
        (outcome,) = [o for o in measured.outcomes if o.metric.measure == metric]
        k, n = int(sum(outcome.scores)), outcome.n
        lo, hi = wilson(k, n)
        done[task] = {"metric": metric, "correct": k, "n": n, "accuracy": k / n, "interval": [lo, hi],
                      "chance": CHANCE[task], "above_chance": lo > CHANCE[task],
                      "num_fewshot": cfg.eval.tasks.fewshot_for(task), "seconds": round(time.monotonic() - start)}
        print(task, done[task], flush=True)
        out.write_text(json.dumps(done, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
