"""Tools that look inside a run: where two layouts part (compare, capture), what each layer does
(layer statistics, loss spikes), who is slow (stragglers, merged traces), what the machine can do
(doctor, collective probe) and what a checkpoint or a batch holds (inspect, batch dumps).

It sits above checkpoint and below inference and training in the layer order: the training loop
calls its hooks, and the `debug`, `doctor` and `inspect` commands drive it."""
