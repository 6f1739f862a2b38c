"""The discrete-event simulator: the live system's policies on a virtual clock (docs/simulator.md).

    sim.executor   a worker's fill executor (its FillQueue): prefill blocks inside its bubbles
    sim.serving    the serving plane: the workers' executors, the dispatchers and the front door, the bus between them
    sim.serving_config  what it is configured with
    sim.dispatchers  one DispatchState for the run, or one per datacenter
    sim.front_door   admission, placement and (per datacenter) routing of each request
    sim.workload   request arrivals: the load generator's processes or an Azure trace
    sim.setup      a cluster spec read as the simulator's inputs
    sim.run        one simulation: BubbleTea off, then on, and the run's figures
    sim.output     the figures, the printed summary, the run folder
    sim.command    `bubbletea simulate`

Training on the virtual clock is `shared.policies.pipeline_run.PipelineRun` (the analytic model's
engine; every slot drives `shared.policies.walk.SlotWalk`, as the live worker does) on the clock of
`shared.policies.events`. Nothing in `shared/` or `services/` imports this package; it only feeds
their policies.
"""
