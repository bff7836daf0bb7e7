"""Audit: read back what a conversion decided, and where its numbers diverge."""

from mpgraph.audit.compare import CompareReport, ValueDivergence, compare
from mpgraph.audit.report import AuditReport, audit

__all__ = ["AuditReport", "CompareReport", "ValueDivergence", "audit", "compare"]
