"""Resilience toward upstreams: safe retries with backoff, retry budgets, circuit breakers."""
