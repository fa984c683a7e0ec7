"""The pass manager: what a pass is, the registry of names, the order passes run in, running stages
with verification, rollback, instruments, the report and the graph dumps."""
from picofx.manager.dump import DumpGraphs
from picofx.manager.pass_manager import PassManager, copy_graph
from picofx.manager.passes import (PASSES, Context, GraphRole, Instrument, PassInfo, PassRecord, PassResult, Stage,
                                   SyncMode, pass_info, pass_name, register_pass, resolve_pass, resolve_passes)
from picofx.manager.report import Report

__all__ = ["PASSES", "Context", "DumpGraphs", "GraphRole", "Instrument", "PassInfo", "PassManager", "PassRecord",
           "PassResult", "Report", "Stage", "SyncMode", "copy_graph", "pass_info", "pass_name", "register_pass",
           "resolve_pass", "resolve_passes"]
