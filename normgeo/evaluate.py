"""Downstream evaluation of trained arms through
lm-evaluation-harness: ``python -m normgeo.evaluate RUN_DIR...``.

Each run's checkpoint (``--step N``, default its highest saved step) is exported as a Hugging Face directory
(:mod:`normgeo.export`, into a temporary folder) and evaluated with lm-evaluation-harness' own
``simple_evaluate`` on ``HFLM`` (float32, the run's context length). The scores go to ``<run>/eval.json``
(atomically, keeping other tasks' scores), where ``normgeo.compare``'s verdict reads them as paired
contrasts over seeds. Offline, ``--make-task data/tasks`` builds the project's own task
``wiki_next_sentence`` (docs/export.md, "Downstream evaluation"); online, the bundled tasks download their
data: ``--tasks lambada_openai,hellaswag,piqa,arc_easy``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from corpus.atomic import atomic_write_json, full_disk_cause
from corpus.next_sentence import TASK_NAME, write_task
from corpus.refusal import Refusal, refused
from corpus.sources import SourceError
from corpus.tokenize import tiktoken_encoding
from models.hardware import missing_cuda
from normgeo.export import ExportError, choose_checkpoint, export_run
from normgeo.paths import FolderError, check_own_folder
from normgeo.readers.downstream import merged_eval, read_eval
from normgeo.run_folder import RunFolder
from normgeo.runs.run_config import OUTPUT_MARKERS
from normgeo.signals import stop_on_signals

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared/corpora/wikipedia/enwiki-wikiextractor"


def _scores(results: dict, samples: dict, task: str) -> dict:
    """lm-eval's ``"acc,none"`` keys as ``"acc"``, plus how many examples were scored."""
    scores = {key.split(",")[0]: value for key, value in results.items()
              if "," in key and isinstance(value, (int, float))}
    scores["examples"] = samples.get(task, {}).get("effective")
    return scores


def truncated_examples(
    task, context: int, limit: int | None, encode: Callable[[str], list[int]]
) -> int | None:
    """How many of a multiple-choice task's examples (the first ``limit``) have a
    choice whose context + choice is longer than the model's ``context`` tokens:
    lm-eval cuts those from the left, so the model scores a truncated context. None
    for other kinds of task, or when the task's documents cannot be read this way."""
    if getattr(task, "OUTPUT_TYPE", None) != "multiple_choice":
        return None
    try:
        docs = list(itertools.islice(task.eval_docs, limit))
        delimiter = task.config.target_delimiter
        return sum(any(len(encode(f"{task.doc_to_text(doc)}{delimiter}{choice}")) > context
                       for choice in task.doc_to_choice(doc)) for doc in docs)
    except (TypeError, ValueError, KeyError, AttributeError):  # choices that are not text (e.g. indices)
        return None


def task_manager(include_path: Path | None):
    """lm-eval's task index (its bundled tasks, plus the YAMLs under ``include_path``); built once, it takes
    seconds."""
    from lm_eval.tasks import TaskManager  # lm-eval takes seconds to import: only once a task index is needed

    return TaskManager(include_path=str(include_path) if include_path else None)


def evaluate_run(run_dir: Path, tasks: Sequence[str], manager, step: int | None = None,
                 limit: int | None = None, batch_size: int = 8, device: str = "cpu") -> dict:
    """Evaluate one run's checkpoint on ``tasks`` (known to ``manager``); write and return its eval.json
    content."""
    # lm-eval takes seconds to import: only once every option has been checked (main).
    import lm_eval.models.huggingface
    import lm_eval.tasks

    with tempfile.TemporaryDirectory(prefix="normgeo-eval-") as scratch:
        exported = export_run(run_dir, "hf", Path(scratch) / "hf", step=step)
        # HFLM reads the context length from the config (n_positions / max_position_embeddings).
        model = lm_eval.models.huggingface.HFLM(pretrained=str(exported.out_dir), trust_remote_code=True,
                                                batch_size=batch_size, device=device, dtype="float32")
        context = model.max_length  # tokens; longer examples are cut (truncated_examples counts them)
        encode = tiktoken_encoding().encode_ordinary
        truncated = {name: truncated_examples(task, context, limit, encode)
                     for name, task in lm_eval.tasks.get_task_dict(list(tasks), manager).items()
                     if isinstance(name, str)}
        output = lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, limit=limit,
                                         log_samples=False, bootstrap_iters=1000, random_seed=0,
                                         numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    samples = output.get("n-samples", {})
    measured = {"step": exported.step, "checkpoint": str(exported.checkpoint.resolve()), "limit": limit,
                "context": context, "lm_eval_version": lm_eval.__version__}
    scores = {task: _scores(values, samples, task) for task, values in output["results"].items()}
    for task, count in truncated.items():
        if count is not None and task in scores:
            scores[task]["truncated"] = count  # examples the model saw cut to its context (from the left)
            if count:
                print(
                    f"warning: {run_dir}: {task}: {count} of {scores[task].get('examples')} examples are "
                    f"longer than the model's {context}-token context; lm-eval cut them from the left, so "
                    "the score is of truncated examples (eval.json records the count)",
                    file=sys.stderr,
                )
    record = merged_eval(read_eval(run_dir), measured, scores)  # earlier tasks' scores are kept
    atomic_write_json(RunFolder(run_dir).eval, record)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="normgeo-evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="*", type=Path, help="train.py run directories")
    parser.add_argument("--tasks", default=TASK_NAME,
                        help=f"comma-separated lm-eval tasks (default {TASK_NAME})")
    parser.add_argument("--include-path", type=Path, default=None,
                        help="a folder of task YAMLs (--make-task's)")
    parser.add_argument("--step", type=int, default=None,
                        help="evaluate checkpoints/step-<N>.ckpt of every run")
    parser.add_argument("--limit", type=int, default=None, help="at most this many examples per task")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:0, ...")
    parser.add_argument(
        "--make-task",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"build the offline task {TASK_NAME} into DIR (then --include-path DIR) and exit",
    )
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="--make-task's WikiExtractor folder")
    parser.add_argument("--examples", type=int, default=500, help="--make-task's number of examples")
    args = parser.parse_args(argv)
    # The temporary export is removed and eval.json keeps
    # what it held (the runs evaluated before it: updated).
    stop_on_signals("during the evaluation", "run the same command again")

    if args.make_task is not None:
        try:  # a folder of its own: never inside a run or another command's outputs
            check_own_folder(args.make_task, "--make-task", OUTPUT_MARKERS, own=None, beside="tasks")
        except FolderError as exc:
            return refused(exc)
        try:
            config = write_task(args.make_task, args.corpus, args.examples)
        except (SourceError, ValueError) as exc:
            return refused(f"--corpus {args.corpus}: {exc}")
        print(f"wrote {config} and its data: add --include-path {args.make_task} --tasks {TASK_NAME}")
        return 0
    if not args.run_dirs:
        parser.print_usage(sys.stderr)
        return refused("give run directories to evaluate (or --make-task DIR)")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    # Every refusal before the first (slow) evaluation: the options, the checkpoints, the run folders
    # (eval.json is written into each after its evaluation), the include path, the task names.
    refusal = (f"--tasks {args.tasks!r}: no task name in it; give e.g. --tasks {TASK_NAME}" if not tasks else
               f"--limit {args.limit}: give at least 1 example per task, or leave --limit out for all of them"
               if args.limit is not None and args.limit < 1 else
               f"--batch-size {args.batch_size}: give at least 1" if args.batch_size < 1 else
               missing_cuda("--device", args.device, "--device cpu"))
    if refusal:
        return refused(refusal)
    try:
        for run_dir in args.run_dirs:
            choose_checkpoint(run_dir, args.step)
            read_eval(run_dir)  # a damaged eval.json is named now, not after the evaluation
            if not os.access(run_dir, os.W_OK):
                raise ExportError(
                    f"run directory {run_dir} is not writable: its eval.json could not be saved after "
                    "the evaluation (chmod u+w it, or evaluate a copy)"
                )
    except (Refusal, ValueError) as exc:
        return refused(exc)
    if args.include_path is not None and not args.include_path.is_dir():
        return refused(f"--include-path {args.include_path}: no such folder (build it with --make-task)")
    manager = task_manager(args.include_path)
    unknown = sorted(set(tasks) - set(manager.all_tasks))
    if unknown:
        hint = (" (build the local task with --make-task DIR and add --include-path DIR)"
                if TASK_NAME in unknown else "")
        return refused(f"--tasks: unknown lm-eval task(s) {', '.join(unknown)}{hint}")
    for run_dir in args.run_dirs:
        try:
            record = evaluate_run(
                run_dir, tasks, manager, args.step, args.limit, args.batch_size, args.device
            )
        except Refusal as exc:  # e.g. a truncated checkpoint: the runs before it keep their scores
            return refused(f"{run_dir}: {exc}")
        except OSError as exc:
            if (full := full_disk_cause(exc)) is None:
                raise
            return refused(f"{run_dir}: the disk is full ({full.filename or run_dir}): its eval.json is as "
                           "it was; free some space and run the same command again")
        scores = "; ".join(
            f"{task} acc {values.get('acc', float('nan')):.4f}" for task, values in record["tasks"].items()
        )
        print(f"{run_dir} (step {record['step']}): {scores} -> {RunFolder(run_dir).eval}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
