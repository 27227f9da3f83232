"""Evaluation (perplexity, passkey / NIAH / MQAR accuracy) and ablation grids with tables and plots."""

from lcx.eval.config import AblateConfig, EvalConfig, RopeVariant
from lcx.eval.evaluate import grade, perplexity, retrieval_accuracy
from lcx.eval.cell_prompts import CellPrompts, prompts
from lcx.eval.grid import run_ablate, run_eval
from lcx.eval.report import markdown_table, read_csv, write_report

__all__ = ["AblateConfig", "CellPrompts", "EvalConfig", "RopeVariant", "grade", "markdown_table", "perplexity",
           "prompts", "read_csv", "retrieval_accuracy", "run_ablate", "run_eval", "write_report"]
