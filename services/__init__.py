"""Shared parts of deltarl: wire schemas, the weight-sync library (delta codec, bucket backends,
publication and catch-up planning), settings helpers, and the coordinator service."""
