"""The reverse proxy: routing, RFC 9110 header rules, the upstream HTTP client."""
