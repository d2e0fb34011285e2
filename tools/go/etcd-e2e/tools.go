//go:build tools

// Package e2e pins etcd's own end-to-end tests (go.etcd.io/etcd/tests/v3, packages e2e and
// common) so scripts/etcd-conformance can compile them with `go test -c -tags e2e` from the
// Go module proxy alone. Nothing here is built into a program; the import only keeps the
// requirement and its checksums in go.mod and go.sum.
package e2e

import (
	_ "go.etcd.io/etcd/tests/v3/common"
	_ "go.etcd.io/etcd/tests/v3/e2e"
)
