"""One request's journey once it is read: the paths to an answer (disaggregated, local, rescue,
first token from P), the relay of D's answer, the neutral request id."""
