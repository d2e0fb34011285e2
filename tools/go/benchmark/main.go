// Command benchmark is etcd's benchmark tool (go.etcd.io/etcd/v3/tools/benchmark, pinned in
// go.mod), built from the Go module proxy to load `keel serve` and etcd the same way.
package main

import (
	"fmt"
	"os"

	"go.etcd.io/etcd/v3/tools/benchmark/cmd"
)

func main() {
	if err := cmd.RootCmd.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
