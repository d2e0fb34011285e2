// Command etcd is the etcd 3.6 server (go.etcd.io/etcd/server/v3/etcdmain, pinned in go.mod),
// built from the Go module proxy as the known-good peer for keelcheck and side-by-side benchmarks.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
