"""The coordinator's HTTP API: its routes (LMCache's and kvatlas' own), the bearer-token
guard, and `edge/`, the HTTP/1.1 server they run on."""
