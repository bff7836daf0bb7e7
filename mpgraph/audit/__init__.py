"""Audit: read back what a conversion decided."""

from mpgraph.audit.report import AuditReport, audit

__all__ = ["AuditReport", "audit"]
