"""xPyD's test suite: unit/, e2e/ (real vLLM), deploy/ (docker, haproxy, prometheus,
kubectl), and support/, the code they share with scripts/ (tests.support.X)."""
