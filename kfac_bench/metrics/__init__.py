"""What every run records: time-to-accuracy, throughput, K-FAC stage times, and the sinks that write them."""
