"""The report: findings, the equation-level program diff, source edits, and memory figures."""

from autoopt._finding import KINDS, Finding
from autoopt.report._report import Report, log_report

__all__ = ["Finding", "KINDS", "Report", "log_report"]
