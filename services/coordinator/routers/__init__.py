"""One router per resource; each route is thin: auth dependency, service call, response_model."""
