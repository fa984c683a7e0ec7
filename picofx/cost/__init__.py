"""The cost model: devices, FLOPs and bytes per node, liveness and step memory, the partition
simulation, recompute analysis and symbolic fits. `cost.inductor` models Inductor's memory.
Everything here reads graphs and predicts; nothing here changes a graph or imports a pass."""
