"""The discrete-event simulator: the live system's policies on a virtual clock (docs/simulator.md).

    sim.events     the virtual clock (a heap of timed callbacks)
    sim.training   the slots walking their schedules: WAN links, all-reduce, bubbles
    sim.executor   a worker's fill executor (FillPolicy): prefill blocks inside its bubbles
    sim.serving    the front door, the dispatcher (DispatchState) and the bus between them
    sim.workload   request arrivals: the load generator's processes or an Azure trace
    sim.setup      a cluster spec read as the simulator's inputs
    sim.run        one simulation: BubbleTea off, then on, and the run's figures
    sim.output     the figures, the printed summary, the run folder
    sim.command    `bubbletea simulate`

Nothing in `shared/` or `services/` imports this package; it only feeds their policies.
"""
