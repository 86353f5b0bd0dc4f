"""The report: findings, the equation-level program diff, source edits, and memory figures."""

from autoopt.explain._finding import KINDS, Finding
from autoopt.explain._report import Report

__all__ = ["Finding", "KINDS", "Report"]
