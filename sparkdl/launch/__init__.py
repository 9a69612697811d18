"""Launch: the TrainSpec crossing to executors, the barrier job, the rendezvous and the in-task main."""
